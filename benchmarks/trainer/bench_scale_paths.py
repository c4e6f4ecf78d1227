"""Throughput of padded vs token-budget micro-batches, and peak memory of the fused lm-head vs the logits path.

`throughput`: one process (TP = PP = DP = 1), a tiny Megatron GPTModel, a length-skewed batch (log-normal response
lengths, issue 14's shape scaled down); times the actor's log-prob pass and one update with fixed micro-batches
(`ppo_micro_batch_size_per_gpu` rows padded to the batch's longest row), with token budgets (`use_dynamic_bsz`), with
padding-free packing of the fixed micro-batches (`use_remove_padding`) and with both (the budget then counts real
tokens), and reports real (prompt + response) tokens per second (modes alternate `--repeats` times, the last of each
counts).

`memory`: the log-prob head alone, as the actor runs it after the decoder, forward and backward: `hidden @ W.T`
then `logprobs_and_entropy` on the logits, or `linear_logprobs_and_entropy` on hidden and W; each mode in a fresh
process, peak resident memory above the inputs' (ru_maxrss).

    python benchmarks/trainer/bench_scale_paths.py throughput
    python benchmarks/trainer/bench_scale_paths.py memory --vocab 152064 --hidden 256 --tokens 2048
"""
from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _maxrss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def memory_mode(args: argparse.Namespace) -> dict:
    from megatron_cpo.kernels import linear_logprobs_and_entropy, logprobs_and_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    before = _maxrss_mib()
    start = time.perf_counter()
    if args.mode == "fused":
        log_probs, entropy = linear_logprobs_and_entropy(hidden, weight, targets, temperature=0.7)
    else:
        log_probs, entropy = logprobs_and_entropy(hidden @ weight.T, targets, temperature=0.7)
    (log_probs.sum() + 0.01 * entropy.sum()).backward()
    return {"mode": args.mode, "peak_above_inputs_mib": round(_maxrss_mib() - before, 1),
            "seconds": round(time.perf_counter() - start, 2), "log_prob_sum": float(log_probs.sum())}


def throughput_mode(args: argparse.Namespace) -> dict:
    from megatron_cpo import platform
    from megatron_cpo.algorithms.losses import PolicyLossConfig
    from megatron_cpo.config import build_config
    from megatron_cpo.models.tiny import write_tiny_model
    from megatron_cpo.trainer.actor import UpdateInputs
    from megatron_cpo.trainer.micro_batches import MicroBatching
    from megatron_cpo.trainer.sequences import pack_sequences
    from megatron_cpo.trainer.workers import build_policies

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "model", max_position_embeddings=8192)
    config = build_config({}, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-5",
                               "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1"])
    platform.init_distributed(1, 1, seed=1)
    actor, _ = build_policies(config, pad_token_id=0, total_updates=10)
    generator = torch.Generator().manual_seed(0)
    sigma = 0.8
    mu = math.log(args.mean_response) - sigma * sigma / 2
    lengths = torch.clamp(torch.distributions.LogNormal(mu, sigma).sample((args.rows,)).long() + 1,
                          max=args.max_response)
    prompts = [torch.randint(3, 100, (args.prompt_len,), generator=generator).tolist() for _ in range(args.rows)]
    responses = [torch.randint(3, 100, (int(n),), generator=generator).tolist() for n in lengths]
    seqs = pack_sequences(prompts, responses, 0, args.max_response)
    real = int(seqs.lengths().sum())
    mask = seqs.response_mask()
    results = {"rows": args.rows, "real_tokens": real, "longest": seqs.length,
               "real_over_padded": round(real / (seqs.rows * seqs.length), 3)}
    fixed, budget = MicroBatching(args.micro_batch_size), MicroBatching(args.micro_batch_size, args.token_budget,
                                                                        args.token_budget)
    modes = {"padded": (fixed, None), "dynamic": (budget, None), "packed": (fixed, "rows"),
             "packed_dynamic": (budget, "rows")}
    actor.log_probs(seqs.select(slice(0, 2)), temperature=1.0)  # warm-up: first-call costs stay out of the timings
    for name, (batching, packing) in [*modes.items()] * args.repeats:  # each mode's last repeat is reported
        actor.batching, actor.packing = batching, packing
        start = time.perf_counter()
        log_probs, _ = actor.log_probs(seqs, temperature=1.0)
        forward = time.perf_counter() - start
        inputs = UpdateInputs(mask * 0.1, log_probs, None, None)
        start = time.perf_counter()
        actor.update(seqs, inputs, PolicyLossConfig(), temperature=1.0)
        update = time.perf_counter() - start
        results[name] = {"log_prob_s": round(forward, 2), "update_s": round(update, 2),
                         "log_prob_real_tokens_per_s": round(real / forward), "update_real_tokens_per_s":
                         round(real / update)}
    platform.destroy_distributed()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("throughput", "memory"))
    parser.add_argument("--mode", choices=("fused", "logits"), help="memory: run one mode in this process")
    parser.add_argument("--vocab", type=int, default=152064)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--mean-response", type=int, default=300)
    parser.add_argument("--max-response", type=int, default=2048)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.what == "throughput":
        print(json.dumps({"load_average_1m": load, **throughput_mode(args)}))
    elif args.mode:
        print(json.dumps(memory_mode(args)))
    else:
        for mode in ("logits", "fused"):
            out = subprocess.run([sys.executable, __file__, "memory", "--mode", mode, "--vocab", str(args.vocab),
                                  "--hidden", str(args.hidden), "--tokens", str(args.tokens)],
                                 check=True, capture_output=True, text=True).stdout
            print(json.dumps({"load_average_1m": load, "vocab": args.vocab, "hidden": args.hidden,
                              "tokens": args.tokens, **json.loads(out.strip().splitlines()[-1])}))


if __name__ == "__main__":
    main()
