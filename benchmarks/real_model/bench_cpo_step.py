"""A SmolLM2 CPO step's actor work beside GRPO's and DAPO's, on the same captured batch: CPU seconds of each part.

The batch is one real step of the example (`capture_batch.py`: 8 prompts x 8 samples of two-digit addition at
temperature 0.7, graded), so the difficulty levels CPO's rule selects on are the model's own. Each setting (a row of
`SETTINGS`: an example config, the batch it trains on, and optionally the work the CPO step did before issue 35)
runs in its own process, through the trainer's own `make_step_batch` (with CPO's hinted prompts), `compute_log_probs`,
`compute_advantages` and `update_policy`; settings alternate over `--rounds`, and each process times `--repeats`
steps after one warm-up step. Parts, in CPU seconds of the process (user + system; they count the work and move less
with the load than wall seconds): `hints` (rank 0 builds the hinted prompts), `old_pass` (the separate forward-only
pass), `hint_pass` (the hinted one), `update` (the PPO update, with the shaping when it is done inside it) and
`actor` (their sum with the advantages).

    python benchmarks/real_model/capture_batch.py --out outputs/batches/grpo_step1.pkl
    python benchmarks/real_model/capture_batch.py --filter-groups --out outputs/batches/dapo_step1.pkl
    python benchmarks/real_model/bench_cpo_step.py --rounds 2
"""
from __future__ import annotations

import argparse
import os
import pickle
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from alternated import cpu_seconds, print_result, run_alternated  # noqa: E402

MODEL = ROOT / "examples/smollm2-135m/model"
EXAMPLES = ROOT / "examples/smollm2-135m"
# name -> (example config, captured batch, what the step did before issue 35: a separate old-log-prob pass and every
# response scored under its hint)
SETTINGS: dict[str, tuple[str, str, bool]] = {
    "grpo": ("grpo.yaml", "grpo", False),
    "cpo_grpo": ("cpo_grpo.yaml", "grpo", False),
    "cpo_grpo_before": ("cpo_grpo.yaml", "grpo", True),
    "dapo": ("dapo.yaml", "dapo", False),
    "cpo_dapo": ("cpo.yaml", "dapo", False),
    "cpo_dapo_before": ("cpo.yaml", "dapo", True),
}


class PartClock:
    """CPU and wall seconds of the named parts of one step, including calls made inside another part."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = {}
        self.wall: dict[str, float] = {}

    def wrap(self, name: str, function):
        def timed(*args, **kwargs):
            cpu, wall = cpu_seconds(), time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.cpu[name] = self.cpu.get(name, 0.0) + cpu_seconds() - cpu
                self.wall[name] = self.wall.get(name, 0.0) + time.perf_counter() - wall
        return timed


def run_setting(name: str, batches: dict[str, str], repeats: int, port: int) -> dict:
    import torch
    from transformers import AutoTokenizer

    from megatron_cpo import platform
    from megatron_cpo.algorithms.shapers import CPOShaper
    from megatron_cpo.config import load_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.driver.batching import make_step_batch
    from megatron_cpo.trainer.driver.rollout_side import HintContextBuilder
    from megatron_cpo.trainer.workers import policy_update
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    example, batch_name, before = SETTINGS[name]
    if before:  # the step before issue 35: the separate old-log-prob pass, and every response scored under its hint
        policy_update.old_log_probs_from_update = lambda settings: False
        CPOShaper.hinted_responses = lambda self, correct, group: torch.ones_like(correct, dtype=torch.bool)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    config = load_config(str(EXAMPLES / example), [f"actor_rollout_ref.model.path={MODEL}"])
    with open(batches[batch_name], "rb") as file:
        captured = pickle.load(file)
    tokenizer = AutoTokenizer.from_pretrained(str(MODEL))
    algorithm = config.algorithm
    builder = (HintContextBuilder(algorithm.cpo, config.data, tokenizer, algorithm.shaper.hinted_responses)
               if algorithm.shaper.needs_hint_contexts else None)
    platform.init_distributed(1, 1, seed=1)
    actor, reference = policies_for(config, pad_token_id=tokenizer.pad_token_id, total_updates=repeats + 1)
    settings = policy_update_config(config)
    steps = []
    for index in range(repeats + 1):
        clock = PartClock()
        actor.log_probs_and_routing = clock.wrap("old_pass", type(actor).log_probs_and_routing.__get__(actor))
        actor.log_probs = clock.wrap("hint_pass", type(actor).log_probs.__get__(actor))
        batch = clock.wrap("hints", make_step_batch)(captured["groups"], 1.0, builder)
        log_probs = clock.wrap("log_probs", compute_log_probs)(batch, actor, reference, settings,
                                                               tokenizer.pad_token_id)
        advantages, metrics = clock.wrap("advantages", compute_advantages)(batch, log_probs, settings)
        metrics.update(clock.wrap("update", update_policy)(actor, batch, log_probs, advantages, settings).metrics)
        if index:
            step = {f"{part}_cpu_s": clock.cpu.get(part, 0.0) for part in ("hints", "old_pass", "hint_pass", "update")}
            step.update({f"{part}_s": clock.wall.get(part, 0.0)
                         for part in ("hints", "old_pass", "hint_pass", "update")})
            step["actor_cpu_s"] = sum(clock.cpu.get(part, 0.0) for part in ("log_probs", "advantages", "update"))
            step["actor_s"] = sum(clock.wall.get(part, 0.0) for part in ("log_probs", "advantages", "update"))
            step.update({key: value for key, value in metrics.items()
                         if key == "timing/train_tokens" or key.startswith("cpo/mi") or key in (
                             "cpo/hinted_frac", "cpo/shaped_token_frac", "cpo/kl_mean")})
            steps.append(step)
    platform.destroy_distributed()
    result = {"setting": name, "config": example, "batch": batch_name, "before_issue_35": before,
              "torch_threads": torch.get_num_threads(), "load_1min_end": os.getloadavg()[0],
              "max_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}
    for key in steps[0]:
        result[key] = round(statistics.median(step[key] for step in steps), 3)
    result["steps"] = steps
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    parser.add_argument("--grpo-batch", default="outputs/batches/grpo_step1.pkl")
    parser.add_argument("--dapo-batch", default="outputs/batches/dapo_step1.pkl")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one setting in this process
    parser.add_argument("--port", type=int, default=29641)
    parser.add_argument("--out", default="benchmarks/real_model/cpo_step_results.jsonl")
    args = parser.parse_args()
    batches = {"grpo": args.grpo_batch, "dapo": args.dapo_batch}
    if args.one:
        print_result(run_setting(args.one, batches, args.repeats, args.port))
        return
    if not (MODEL / "config.json").is_file():
        sys.exit(f"error: no model at {MODEL}; fetch it once with python tools/fetch_smollm2.py")
    run_alternated(__file__, args.settings, args.rounds, ["--repeats", str(args.repeats), "--port", str(args.port),
                   "--grpo-batch", args.grpo_batch, "--dapo-batch", args.dapo_batch], args.out, ROOT)


if __name__ == "__main__":
    main()
