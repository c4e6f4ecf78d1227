"""Throughput of padded vs token-budget micro-batches, and peak memory of the fused lm-head vs the logits path.

`throughput`: one process (TP = PP = DP = 1), a tiny Megatron GPTModel, a length-skewed batch (log-normal response
lengths, issue 14's shape scaled down); times the actor's log-prob pass and one update with fixed micro-batches
(`ppo_micro_batch_size_per_gpu` rows padded to the batch's longest row), with token budgets (`use_dynamic_bsz`), with
padding-free packing of the fixed micro-batches (`use_remove_padding`) and with both (the budget then counts real
tokens), and with both plus full activation recompute (`enable_gradient_checkpointing`), and reports real (prompt +
response) tokens per second (modes alternate `--repeats` times; the median time of each mode counts: the machine is
shared and loaded, so single timings swing by 2x and more).

`memory`: the log-prob head alone, as the actor runs it after the decoder, forward and backward: `hidden @ W.T`
then `log_probs_and_entropy` on the logits, or `linear_log_probs_and_entropy` on hidden and W; each mode in a fresh
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
    from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy

    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=generator).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.02).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=generator)
    before = _maxrss_mib()
    start = time.perf_counter()
    if args.mode == "fused":
        log_probs, entropy = linear_log_probs_and_entropy(hidden, weight, targets, temperature=0.7)
    else:
        log_probs, entropy = log_probs_and_entropy(hidden @ weight.T, targets, temperature=0.7)
    (log_probs.sum() + 0.01 * entropy.sum()).backward()
    return {"mode": args.mode, "peak_above_inputs_mib": round(_maxrss_mib() - before, 1),
            "seconds": round(time.perf_counter() - start, 2), "log_prob_sum": float(log_probs.sum())}


def throughput_mode(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models.tiny import write_tiny_model
    from megatron_cpo.trainer.batch.sequences import pack_sequences
    from megatron_cpo.trainer.components import policies_for
    from megatron_cpo.trainer.workers.actor import UpdateInputs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    model_dir = write_tiny_model(Path(tempfile.mkdtemp()) / "model", max_position_embeddings=8192)
    config = build_config({}, [f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-5",
                               "data.train_batch_size=1", "actor_rollout_ref.actor.ppo_mini_batch_size=1"])
    platform.init_distributed(1, 1, seed=1)
    actor, _ = policies_for(config, pad_token_id=0, total_updates=10)
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
    fixed = replace(actor.config, ppo_micro_batch_size_per_gpu=args.micro_batch_size, use_dynamic_bsz=False)
    budget = replace(fixed, use_dynamic_bsz=True, ppo_max_token_len_per_gpu=args.token_budget,
                     log_prob_max_token_len_per_gpu=args.token_budget)
    modes = {"padded": (fixed, None, False), "dynamic": (budget, None, False), "packed": (fixed, "rows", False),
             "packed_dynamic": (budget, "rows", False), "packed_dynamic_recompute": (budget, "rows", True)}
    timings: dict[str, list[tuple[float, float]]] = {name: [] for name in modes}
    actor.log_probs(seqs.select(slice(0, 2)), temperature=1.0)  # warm-up: first-call costs stay out of the timings
    for name, (batching, packing, recompute) in [*modes.items()] * args.repeats:
        actor.config, actor.packing = batching, packing
        # Megatron reads these at every forward: full recompute of each layer, as enable_gradient_checkpointing sets
        actor.model.config.recompute_granularity = "full" if recompute else None
        actor.model.config.recompute_method = "uniform" if recompute else None
        actor.model.config.recompute_num_layers = 1 if recompute else None
        start = time.perf_counter()
        log_probs, _ = actor.log_probs(seqs, temperature=1.0)
        forward = time.perf_counter() - start
        inputs = UpdateInputs(mask * 0.1, log_probs, None, None)
        start = time.perf_counter()
        actor.update(seqs, inputs, temperature=1.0)
        update = time.perf_counter() - start
        timings[name].append((forward, update))
    for name, runs in timings.items():
        forward = sorted(f for f, _ in runs)[len(runs) // 2]
        update = sorted(u for _, u in runs)[len(runs) // 2]
        results[name] = {"log_prob_s": round(forward, 2), "update_s": round(update, 2),
                         "log_prob_real_tokens_per_s": round(real / forward), "update_real_tokens_per_s":
                         round(real / update), "all_runs_s": [[round(f, 2), round(u, 2)] for f, u in runs]}
    platform.destroy_distributed()
    results["plan_memory_model"] = _planned_ratios(model_dir, seqs.lengths(), seqs.length)
    return results


def _planned_ratios(model_dir: Path, lengths: torch.Tensor, longest: int) -> dict:
    """What tools/plan_memory.py's step-time model predicts for this batch: a forward-only pass over an update, the
    update with full recompute over without, and the padded FLOPs over the padding-free ones (the speed-up it
    expects from dynamic / packed modes)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from plan_memory import ModelShape, attention_flops

    shape = ModelShape.from_hf_config(json.loads((Path(model_dir) / "config.json").read_text()))
    params = shape.total_params()
    padded = len(lengths) * (2 * params * longest + attention_flops(shape, longest))
    real = sum(2 * params * int(n) + attention_flops(shape, int(n)) for n in lengths)
    return {"log_prob_over_update": round(1 / 3, 3), "recompute_update_over_update": round(4 / 3, 3),
            "padded_over_padding_free_flops": round(padded / real, 2)}


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    if args.what == "throughput":
        results = throughput_mode(args)
        print(json.dumps({"load_average_1m": load, "load_average_1m_end": os.getloadavg()[0], **results}))
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
