"""Agent episodes with a slow tool, synchronous (k = 0) against asynchronous (k = 1) training.

Each run is the multi-turn learning run of README.md (`examples/tiny/arith_retry.yaml`: GRPO on two-try arithmetic
episodes, 8 prompts x 8 episodes a step, greedy validation on the 80 held-out questions every `--test-freq` steps)
with one change: every environment step first waits a seeded random 0-2 s (slow_tool_env.py), as a tool call would,
on one of 64 environment threads (`multi_turn.env_workers`; a waiting tool holds a thread, not a core). Arms:
`async_training.max_staleness` 0 and 1, `--seeds` each (`trainer.seed`, which also seeds the waits).

Reported per arm (means over seeds): the wall time of a step without its validation (`timing/step_s -
timing/val_s`, median over steps after the first), the trainer's idle time per step (`timing/gen_s`: every rank
waits for rank 0's batch), the final held-out success (`val/acc`, a right answer within the two tries) and the
run's time to the k = 0 arm's final success (its mean over seeds minus their spread; per seed, None when a run never
reached it). A run that finished before (its `run.json` says so) is read, not run again (`--rerun` runs it again),
so re-running continues a table cut short; a failed run is named at the end and the others still run. `--smoke`
proves the harness in a few minutes (its numbers say nothing).

    python benchmarks/multi_turn/bench_async_episodes.py            # 2 arms x 3 seeds x 20 steps
    python benchmarks/multi_turn/bench_async_episodes.py --smoke    # 2 arms x 1 seed x 3 steps, 16 questions
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "async"))

from bench_async import finished, read_run, time_to  # noqa: E402

CONFIG = REPO / "examples" / "tiny" / "arith_retry.yaml"
AGENT = "benchmarks/multi_turn/slow_tool_env.py:SlowToolArithmeticRetry"
ARMS = {"k0": 0, "k1": 1}


def write_data(data: Path) -> None:
    """The README's data: levels 1-2 of the synthetic arithmetic task."""
    if not (data / "test.parquet").is_file():
        subprocess.run([sys.executable, "-m", "megatron_cpo.data.synthetic", "--out", str(data), "--keep-levels", "1",
                        "2"], cwd=REPO, check=True)


def run_arm(name: str, seed: int, steps: int, test_freq: int, data: Path, root: Path, val_samples: int) -> Path:
    """One training run; returns its output directory (run/metrics.jsonl, train.console, run.json)."""
    out = root / name / f"seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "megatron_cpo.trainer", "--config", str(CONFIG),
               f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
               f"data.val_max_samples={val_samples}", f"trainer.default_local_dir={out / 'run'}",
               "trainer.resume=disable", f"trainer.seed={seed}", f"trainer.total_training_steps={steps}",
               f"trainer.test_freq={test_freq}", "trainer.logger=[jsonl]",
               "actor_rollout_ref.rollout.ray_address=local",
               f"actor_rollout_ref.rollout.multi_turn.default_agent={AGENT}",
               "actor_rollout_ref.rollout.multi_turn.env_workers=64",
               f"async_training.max_staleness={ARMS[name]}"]
    started, load = time.perf_counter(), os.getloadavg()
    with (out / "train.console").open("wb") as console:
        returncode = subprocess.run(command, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=console,
                                    stderr=subprocess.STDOUT).returncode
    (out / "run.json").write_text(json.dumps({"arm": name, "seed": seed, "steps": steps, "returncode": returncode,
                                              "wall_s": time.perf_counter() - started, "loadavg_start": load,
                                              "loadavg_end": os.getloadavg()}) + "\n")
    if returncode != 0:
        raise RuntimeError(f"{name} seed {seed} failed (rc {returncode}); see {out / 'train.console'}")
    return out


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    """Per arm: step time, trainer idle time, final success and its spread, time to the k = 0 arm's final success."""
    base = [r["final_acc"] for r in results.get("k0", {}).values()]
    target = statistics.fmean(base) - (statistics.stdev(base) if len(base) > 1 else 0.0) if base else None
    table = {"target_acc": target, "arms": {}}
    for name, runs in results.items():
        finals = [r["final_acc"] for r in runs.values()]
        table["arms"][name] = {
            "seeds": sorted(runs), "step_s": statistics.fmean(r["step_s"] for r in runs.values()),
            "trainer_idle_s": statistics.fmean(r["trainer_idle_s"] for r in runs.values()),
            "final_acc": statistics.fmean(finals),
            "final_acc_std": statistics.stdev(finals) if len(finals) > 1 else 0.0,
            "time_to_target_s": [time_to(r["curve"], target) if target is not None else None for r in runs.values()],
            "runs": runs}
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--val-samples", type=int, default=-1, help="held-out questions per validation (-1: all 80)")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "multi_turn_async_bench")
    parser.add_argument("--out", type=Path, default=HERE / "async_results.json")
    parser.add_argument("--rerun", action="store_true", help="run again the runs that finished before")
    parser.add_argument("--smoke", action="store_true", help="both arms, seed 1, 3 steps, 16 questions")
    args = parser.parse_args()
    if args.smoke:
        args.seeds, args.steps, args.test_freq, args.val_samples = [1], 3, 3, 16
        args.out = args.root / "smoke_results.json"
    data = args.root / "data"
    write_data(data)
    results: dict[str, dict[int, dict]] = {}
    failed: list[str] = []
    for seed in args.seeds:  # arms round-robin, so a table cut short stays balanced
        for name in args.arms:
            out = args.root / name / f"seed{seed}"
            if not args.rerun and finished(out, args.steps):
                print(f"{name} seed {seed}: finished before, read from {out}", flush=True)
            else:
                print(f"{name} seed {seed} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                try:
                    run_arm(name, seed, args.steps, args.test_freq, data, args.root, args.val_samples)
                except RuntimeError as error:
                    print(f"    FAILED: {error}", flush=True)
                    failed.append(f"{name} seed {seed}: {error}")
                    continue
            run = results.setdefault(name, {})[seed] = read_run(out)
            print(f"    step {run['step_s']:.2f} s, trainer idle {run['trainer_idle_s']:.2f} s, "
                  f"final val/acc {run['final_acc']:.3f}", flush=True)
    table = summarize(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **table, "failed": failed},
                                   indent=1) + "\n")
    for name, row in table["arms"].items():
        print(f"{name}: step {row['step_s']:.2f} s, trainer idle {row['trainer_idle_s']:.2f} s / step, final success "
              f"{row['final_acc']:.3f} +- {row['final_acc_std']:.3f}, time to {table['target_acc']:.3f}: "
              f"{row['time_to_target_s']}")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
