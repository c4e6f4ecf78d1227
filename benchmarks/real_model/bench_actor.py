"""The Megatron actor alone on SmolLM2-135M-Instruct: seconds and CPU seconds of the log-prob pass and the update.

One RL step's actor work without the engines: a batch shaped like the example's step (8 prompts x 8 samples, a
52-token prompt, responses of 24-128 tokens, 4,928 response tokens), through the trainer's own `build_policies`,
`compute_log_probs` and `update_policy`. Each setting (a row of `SETTINGS`: dotted overrides of the example's GRPO
config) runs in its own process; settings alternate `--rounds` times so that load changes hit all of them alike, and
each process times `--repeats` steps after one warm-up step. CPU seconds (user + system of the process) count the work
and move less with the load than wall seconds on a shared machine.

    python benchmarks/real_model/bench_actor.py --settings fp32 bf16 --rounds 2
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from alternated import cpu_seconds, print_result, run_alternated  # noqa: E402

# The starting point, overridden by each setting: fp32, micro-batches of 16 padded rows, the logits path, and
# a separate old-log-prob pass (`+old_log_probs=from_update` lets the on-policy update compute them instead, as the
# trainer does when `policy_update.old_log_probs_from_update` holds; `+threads=N` sets torch's intra-op threads).
BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.megatron.params_dtype=float32", "actor_rollout_ref.model.use_fused_kernels=false",
        "actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.model.use_remove_padding=false",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false"]
BF16 = ["actor_rollout_ref.actor.megatron.params_dtype=bfloat16"]
SKIP = ["+old_log_probs=from_update"]
DYNAMIC = ["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
           "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=4096"]
PACKED = ["actor_rollout_ref.model.use_remove_padding=true"]
FUSED = ["actor_rollout_ref.model.use_fused_kernels=true"]
SELECTIVE = ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
             "actor_rollout_ref.actor.megatron.recompute_granularity=selective"]
FULL = ["actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.megatron.recompute_granularity=full"]
BUDGET_1024 = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=1024"]
BUDGET_2048 = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=2048"]
BUDGET_8192 = ["actor_rollout_ref.actor.ppo_max_token_len_per_gpu=8192"]
# A ladder: each row adds one change to the row before it (the example's settings are the last rows).
SETTINGS: dict[str, list[str]] = {
    "fp32": [],
    "bf16": BF16,
    "bf16_skip": BF16 + SKIP,
    "bf16_skip_dynamic": BF16 + SKIP + DYNAMIC,
    "bf16_skip_dynamic_packed": BF16 + SKIP + DYNAMIC + PACKED,
    "bf16_skip_dynamic_fused": BF16 + SKIP + DYNAMIC + FUSED,
    "bf16_skip_dynamic_packed_fused": BF16 + SKIP + DYNAMIC + PACKED + FUSED,
    "bf16_skip_dynamic_selective": BF16 + SKIP + DYNAMIC + SELECTIVE,
    "bf16_skip_dynamic_fused_selective": BF16 + SKIP + DYNAMIC + FUSED + SELECTIVE,
    "bf16_skip_dynamic2048_fused_selective": BF16 + SKIP + DYNAMIC + BUDGET_2048 + FUSED + SELECTIVE,
    "bf16_skip_dynamic1024_fused_selective": BF16 + SKIP + DYNAMIC + BUDGET_1024 + FUSED + SELECTIVE,
    "bf16_skip_dynamic8192_fused_full": BF16 + SKIP + DYNAMIC + BUDGET_8192 + FUSED + FULL,
    "bf16_skip_dynamic2048_fused_selective_threads1": BF16 + SKIP + DYNAMIC + BUDGET_2048 + FUSED + SELECTIVE
    + ["+threads=1"],
    "bf16_skip_dynamic_threads1": BF16 + SKIP + DYNAMIC + ["+threads=1"],
    "fp32_skip": SKIP,
}
MODEL = ROOT / "examples/smollm2-135m/model"
CONFIG = ROOT / "examples/smollm2-135m/grpo.yaml"


def make_batch(prompts: int, n: int, prompt_len: int, seed: int):
    """A StepBatch of random tokens with the example's shape; response lengths spread evenly over 24..128."""
    import torch

    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(seed)
    rows = prompts * n
    lengths = torch.linspace(24, 128, rows).round().long()[torch.randperm(rows, generator=generator)]
    prompt_ids = [torch.randint(100, 40000, (prompt_len,), generator=generator).tolist() for _ in range(prompts)]
    return StepBatch(
        prompt_ids=[prompt_ids[row // n] for row in range(rows)],
        response_ids=[torch.randint(100, 40000, (int(k),), generator=generator).tolist() for k in lengths],
        rollout_log_probs=[[-1.0] * int(k) for k in lengths],
        scores=(torch.rand(rows, generator=generator) > 0.7).float() * 2 - 1, acc=torch.zeros(rows),
        group=torch.arange(rows) // n, truncated=torch.zeros(rows, dtype=torch.bool), kept_ratio=1.0)


def run_setting(name: str, repeats: int, port: int) -> dict:
    """Build the actor under this setting's overrides and time `repeats` steps (after one warm-up)."""
    import torch

    overrides = [o for o in SETTINGS[name] if not o.startswith("+")]
    options = dict(o[1:].split("=") for o in SETTINGS[name] if o.startswith("+"))
    if "threads" in options:
        torch.set_num_threads(int(options["threads"]))
    from megatron_cpo import platform
    from megatron_cpo.config import load_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers import policy_update
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    if options.get("old_log_probs") != "from_update":
        # the separate pass, as before the predicate existed
        policy_update.old_log_probs_from_update = lambda settings: False

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    config = load_config(str(CONFIG), [f"actor_rollout_ref.model.path={MODEL}", *BASE, *overrides])
    platform.init_distributed(1, 1, seed=1)
    actor, reference = policies_for(config, pad_token_id=2, total_updates=repeats + 1)
    settings = policy_update_config(config)
    batch = make_batch(config.data.train_batch_size, config.actor_rollout_ref.rollout.n, 52, seed=0)
    steps = []
    for index in range(repeats + 1):
        times = {}
        for part in ("log_probs", "update"):
            times[part] = (time.perf_counter(), cpu_seconds())
            if part == "log_probs":
                log_probs = compute_log_probs(batch, actor, reference, settings, pad_token_id=2)
                advantages, _ = compute_advantages(batch, log_probs, settings)
            else:
                metrics = update_policy(actor, batch, log_probs, advantages, settings).metrics
            start_wall, start_cpu = times[part]
            times[part] = (time.perf_counter() - start_wall, cpu_seconds() - start_cpu)
        if index:
            steps.append({"log_prob_s": times["log_probs"][0], "log_prob_cpu_s": times["log_probs"][1],
                          "update_s": times["update"][0], "update_cpu_s": times["update"][1],
                          "train_tokens": metrics["timing/train_tokens"]})
    platform.destroy_distributed()
    result = {"setting": name, "overrides": SETTINGS[name], "torch_threads": torch.get_num_threads(),
              "load_1min_end": os.getloadavg()[0],
              "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    for key in ("log_prob_s", "log_prob_cpu_s", "update_s", "update_cpu_s"):
        result[key] = round(statistics.median(step[key] for step in steps), 2)
    result["actor_s"] = round(result["log_prob_s"] + result["update_s"], 2)
    result["actor_cpu_s"] = round(result["log_prob_cpu_s"] + result["update_cpu_s"], 2)
    result["steps"] = steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=sorted(SETTINGS))
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting in this process
    parser.add_argument("--port", type=int, default=29631)
    parser.add_argument("--out", default="benchmarks/real_model/actor_results.jsonl")
    args = parser.parse_args()
    if args.one:
        print_result(run_setting(args.one, args.repeats, args.port))
        return
    if not (MODEL / "config.json").is_file():
        sys.exit(f"error: no model at {MODEL}; fetch it once with python tools/fetch_smollm2.py")
    run_alternated(__file__, args.settings, args.rounds, ["--repeats", str(args.repeats), "--port", str(args.port)],
                   args.out, ROOT)


if __name__ == "__main__":
    main()
