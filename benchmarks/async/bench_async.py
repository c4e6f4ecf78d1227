"""Asynchronous training on the shipped task: wall time per step and time to a held-out accuracy, k = 0, 1, 2.

Each arm is one real run of `examples/tiny/grpo_arith.yaml` on the learning table's shipped task (arith12: 1411 train
prompts, 400 held-out questions; benchmarks/learning/tasks.py) against one `megatron-cpo rollout` server
(`rollout.mode=server`, so the engine and the trainer are separate process trees that can be pinned apart):

- pinned arms (k = 0, 1, 2): the server on core 0 (`taskset -c 0`, vLLM's OpenMP threads bound to it), the trainer and
  its grading worker on core 1 (`taskset -c 1`, one torch/OpenMP thread), so what k > 0 gains is overlap of the two,
  not time-sharing of both cores;
- the unpinned synchronous arm (k = 0): the same processes free on both cores, as a user would run it.

Each run validates before training and every `--test-freq` steps (greedy, 400 questions; the same schedule in every
arm, counted in the wall time: validation shares the engine with the training requests in flight when k > 0).
Reported per arm: wall time per step excluding validation (`timing/step_s - timing/val_s`, median over steps after the
first), the run's wall time to each validation, and the time at which it first reaches the target accuracy (the k = 0
pinned arm's final `val/acc`, mean over seeds, minus its seed spread). Results go to `--out` (JSON) and the
console; `--smoke` makes a short run that proves the harness works (its numbers say nothing). A run that finished
before (its `run.json` says so) is read, not run again (`--rerun` runs it again), so re-running continues a table cut
short; a run that fails is named at the end and the others still run.

    python benchmarks/async/bench_async.py                      # the full table: 4 arms x 3 seeds x 40 steps
    python benchmarks/async/bench_async.py --smoke              # 2 arms x 1 seed x 4 steps, 40 held-out questions
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "learning"))

from tasks import task_overrides, write_task  # noqa: E402

CONFIG = REPO / "examples" / "tiny" / "grpo_arith.yaml"
MODEL = REPO / "examples" / "tiny" / "model"
ENGINE_CORE, TRAINER_CORE = "0", "1"


@dataclass(frozen=True)
class Arm:
    name: str
    max_staleness: int
    pinned: bool

    def prefix(self, core: str) -> list[str]:
        return ["taskset", "-c", core] if self.pinned else []


ARMS = {arm.name: arm for arm in (Arm("k0_pinned", 0, True), Arm("k1_pinned", 1, True), Arm("k2_pinned", 2, True),
                                  Arm("k0_unpinned", 0, False))}


def start_server(arm: Arm, work: Path, token_file: Path) -> tuple[subprocess.Popen, str]:
    """The rollout server of one run (its own session, so the whole tree can be stopped); returns it and its URL."""
    ready = work / "server.url"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    if arm.pinned:
        env["VLLM_CPU_OMP_THREADS_BIND"] = ENGINE_CORE
    log = (work / "server.log").open("wb")
    process = subprocess.Popen([*arm.prefix(ENGINE_CORE), sys.executable, "-m", "megatron_cpo.cli", "rollout",
                                "--model", str(MODEL), "--dtype", "float32", "--max-model-len", "1024", "--port", "0",
                                "--token-file", str(token_file), "--ready-file", str(ready)],
                               cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 1200
    while not ready.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            stop(process)
            raise RuntimeError(f"the rollout server did not start; see {work / 'server.log'}")
        time.sleep(0.5)
    return process, ready.read_text().strip()


def stop(process: subprocess.Popen) -> None:
    """SIGTERM to the process's session (it stops its engines), SIGKILL after 60 s."""
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def run_arm(arm: Arm, seed: int, steps: int, test_freq: int, data: Path, root: Path, val_samples: int) -> Path:
    """One training run of `arm`; returns its output directory (metrics.jsonl, server.log, train console)."""
    out = root / arm.name / f"seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    token_file = out / "token"
    token_file.write_text(secrets.token_hex(16))
    server, url = start_server(arm, out, token_file)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if arm.pinned:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [*arm.prefix(TRAINER_CORE), sys.executable, "-m", "megatron_cpo.cli", "train", "--config", str(CONFIG),
               f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
               f"trainer.default_local_dir={out / 'run'}", "trainer.resume=disable", f"trainer.seed={seed}",
               f"trainer.total_training_steps={steps}", f"trainer.test_freq={test_freq}",
               f"data.val_max_samples={val_samples}",
               f"async_training.max_staleness={arm.max_staleness}", "actor_rollout_ref.rollout.mode=server",
               f"actor_rollout_ref.rollout.server_urls=[{url}]",
               f"actor_rollout_ref.rollout.server_token_file={token_file}",
               "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]", "trainer.logger=[jsonl]",
               *task_overrides("arith12")]
    started = time.perf_counter()
    try:
        with (out / "train.console").open("wb") as console:
            returncode = subprocess.run(command, cwd=REPO, env=env, stdout=console, stderr=subprocess.STDOUT).returncode
    finally:
        stop(server)
    shutil.rmtree(out / "run" / "checkpoints", ignore_errors=True)
    (out / "run.json").write_text(json.dumps({"arm": arm.name, "seed": seed, "steps": steps, "returncode": returncode,
                                              "wall_s": time.perf_counter() - started,
                                              "loadavg": os.getloadavg()}) + "\n")
    if returncode != 0:
        raise RuntimeError(f"{arm.name} seed {seed} failed (rc {returncode}); see {out / 'train.console'}")
    return out


def finished(out: Path, steps: int) -> bool:
    """Whether `out` holds a run of `steps` steps that ended well (so re-running the benchmark continues it)."""
    try:
        run = json.loads((out / "run.json").read_text())
    except (OSError, ValueError):
        return False
    return run.get("returncode") == 0 and run.get("steps") == steps


def read_run(out: Path) -> dict:
    """Per-step wall times (without validation) and the validation curve (seconds since the run began -> acc)."""
    rows = {}
    for line in (out / "run" / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows.setdefault(row.pop("step"), {}).update(row)
    clock, curve, step_times = rows.get(0, {}).get("timing/val_s", 0.0), [], []
    if "val/acc" in rows.get(0, {}):
        curve.append((clock, rows[0]["val/acc"]))
    for step in sorted(s for s in rows if s > 0):
        row = rows[step]
        clock += row["timing/step_s"]
        step_times.append(row["timing/step_s"] - row.get("timing/val_s", 0.0))
        if "val/acc" in row:
            curve.append((clock, row["val/acc"]))
    return {"step_s": statistics.median(step_times[1:] or step_times), "curve": curve, "final_acc": curve[-1][1],
            "engine_idle_s": statistics.fmean(rows[s].get("timing/engine_idle_s", 0.0) for s in rows if s > 1),
            "trainer_idle_s": statistics.fmean(rows[s]["timing/gen_s"] for s in rows if s > 1)}


def time_to(curve: list[tuple[float, float]], target: float) -> float | None:
    return next((seconds for seconds, acc in curve if acc >= target), None)


def summarize(results: dict[str, dict[int, dict]]) -> dict:
    """Per arm: median step time, mean final accuracy and its spread, time to the k = 0 pinned arm's final accuracy."""
    base = [r["final_acc"] for r in results.get("k0_pinned", {}).values()]
    target = statistics.fmean(base) - (statistics.stdev(base) if len(base) > 1 else 0.0) if base else None
    table = {"target_acc": target, "arms": {}}
    for name, runs in results.items():
        reach = [time_to(r["curve"], target) for r in runs.values()] if target is not None else []
        table["arms"][name] = {
            "seeds": sorted(runs), "step_s": statistics.fmean(r["step_s"] for r in runs.values()),
            "final_acc": statistics.fmean(r["final_acc"] for r in runs.values()),
            "final_acc_std": statistics.stdev([r["final_acc"] for r in runs.values()]) if len(runs) > 1 else 0.0,
            "engine_idle_s": statistics.fmean(r["engine_idle_s"] for r in runs.values()),
            "trainer_idle_s": statistics.fmean(r["trainer_idle_s"] for r in runs.values()),
            "time_to_target_s": reach, "runs": runs}
    k0 = table["arms"].get("k0_pinned")
    for row in table["arms"].values():
        if k0 is not None:
            row["step_ratio_vs_k0_pinned"] = row["step_s"] / k0["step_s"]
            reached = [t for t in row["time_to_target_s"] if t is not None]
            base_times = [t for t in k0["time_to_target_s"] if t is not None]
            if reached and base_times and len(reached) == len(row["time_to_target_s"]):
                row["time_to_target_ratio_vs_k0_pinned"] = statistics.fmean(reached) / statistics.fmean(base_times)
    return table


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--test-freq", type=int, default=5)
    parser.add_argument("--val-samples", type=int, default=-1, help="held-out questions per validation (-1: all 400)")
    parser.add_argument("--root", type=Path, default=REPO / "runs" / "async_bench")
    parser.add_argument("--out", type=Path, default=HERE / "results.json")
    parser.add_argument("--rerun", action="store_true", help="run again the arms whose run finished before")
    parser.add_argument("--smoke", action="store_true", help="k0_pinned and k1_pinned, seed 1, 4 steps, 40 questions")
    args = parser.parse_args()
    if args.smoke:
        args.arms, args.seeds, args.steps, args.test_freq, args.val_samples = ["k0_pinned", "k1_pinned"], [1], 4, 2, 40
        args.out = args.root / "smoke_results.json"
    if shutil.which("taskset") is None:
        raise SystemExit("taskset (util-linux) is needed to pin the engine and the trainer to one core each")
    data = args.root / "data"
    write_task("arith12", data)
    results: dict[str, dict[int, dict]] = {}
    failed: list[str] = []
    for seed in args.seeds:  # arms round-robin, so a run cut short stays balanced
        for name in args.arms:
            out = args.root / name / f"seed{seed}"
            if not args.rerun and finished(out, args.steps):
                print(f"{name} seed {seed}: finished before, read from {out}", flush=True)
            else:
                print(f"{name} seed {seed} (load {os.getloadavg()[0]:.1f}) ...", flush=True)
                try:
                    run_arm(ARMS[name], seed, args.steps, args.test_freq, data, args.root, args.val_samples)
                except RuntimeError as error:  # one failed run is reported, the others still run
                    print(f"    FAILED: {error}", flush=True)
                    failed.append(f"{name} seed {seed}: {error}")
                    continue
            results.setdefault(name, {})[seed] = read_run(out)
            print(f"    step {results[name][seed]['step_s']:.2f} s, final val/acc "
                  f"{results[name][seed]['final_acc']:.3f}", flush=True)
    table = summarize(results)
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **table, "failed": failed},
                                   indent=1) + "\n")
    for name, row in table["arms"].items():
        print(f"{name}: step {row['step_s']:.2f} s (x{row.get('step_ratio_vs_k0_pinned', float('nan')):.2f}), final "
              f"acc {row['final_acc']:.3f} +- {row['final_acc_std']:.3f}, time to target {row['time_to_target_s']}, "
              f"engine idle {row['engine_idle_s']:.2f} s, trainer idle {row['trainer_idle_s']:.2f} s / step")
    for line in failed:
        print(f"failed: {line}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
