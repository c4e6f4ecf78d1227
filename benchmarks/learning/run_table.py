"""Re-run the learning table: every (table, algorithm, seed) run as its own `megatron-cpo train` process, one at a time.

    python benchmarks/learning/run_table.py                       # everything, in priority order, then summarize
    python benchmarks/learning/run_table.py --only a              # table (a) only; --only a:cpo:2 one run
    python benchmarks/learning/run_table.py --list                # the commands, without running them

Tables (priority order): (a) GRPO, DAPO, CPO (`negonly_mi3`) on the shipped task; (b) GRPO, CPO and DAPO on the
harder variant (DAPO separates CPO's shaping from the filter-groups it inherits from DAPO); (c) the CPO rule
ablation on the shipped task; (d) the three algorithms of (a) with asynchronous training at k = 1; (e) verl's other
estimators and loss modes; (f) on-policy distillation from a GRPO-trained teacher (the teacher run, 100 steps of GRPO,
goes first when its kept model is missing: `runs/arith12/teacher/seed0/model`, not committed). Within a table
the seeds go round-robin over the algorithms (seed 1 of every algorithm, then seed 2, ...) so a table cut short
stays balanced. A run whose `run.json` says it finished is skipped, so re-running continues the table; `--rerun`
runs it again.

Each run writes under `benchmarks/learning/runs/<task>/<algo>/seed<k>/`: the trainer's `metrics.jsonl` and
`train.log`, and `run.json` (command, exit code, wall and CPU time, load average, the CPU: `machine`). Checkpoints
(the trainer always saves the last step) are deleted after the run. CPU time is measured twice:
`getrusage(RUSAGE_CHILDREN)` (the trainer and every descendant it waited for) and a 1 s sampler over the live
process tree (catches Ray / vLLM processes that are not reaped through the trainer); the larger is what the table
reports. The teacher run keeps its last step's Hugging Face export as `<out_dir>/model` before the checkpoints go.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))

from machine import machine_record  # noqa: E402
from tasks import ALGOS, SEEDS, TABLES, TEACHER_MODEL, TEACHER_RUN, Run, plan, write_task  # noqa: E402


class TreeCpuSampler(threading.Thread):
    """Samples the CPU time of every live descendant of a process once a second; keeps each pid's last value, so the
    sum is the CPU time of the tree up to the last sample before each process ended (an under-estimate by <= 1 s of
    each process's final second). Also samples the load average."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.per_pid, self.loads = pid, {}, []
        self.done = threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                root = psutil.Process(self.pid)
                for process in [root, *root.children(recursive=True)]:
                    try:
                        times = process.cpu_times()
                        self.per_pid[(process.pid, process.create_time())] = times.user + times.system
                    except psutil.Error:
                        pass
            except psutil.Error:
                pass
            self.loads.append(os.getloadavg()[0])
            self.done.wait(1.0)

    @property
    def cpu_s(self) -> float:
        return sum(self.per_pid.values())


def execute(run: Run) -> dict:
    """Run one training process to completion; returns (and writes) its run.json record."""
    if run.out_dir.exists():
        shutil.rmtree(run.out_dir)
    run.out_dir.parent.mkdir(parents=True, exist_ok=True)
    command = run.command()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}".rstrip(os.pathsep)}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started, start_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    log = (HERE / "runs" / "console.log").open("a")
    log.write(f"\n== {started} {' '.join(command)}\n")
    log.flush()
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    sampler = TreeCpuSampler(process.pid)
    sampler.start()
    returncode = process.wait()
    sampler.done.set()
    sampler.join()
    wall = time.perf_counter() - start_wall
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rusage_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    exports = sorted((run.out_dir / "checkpoints").glob("step_*/huggingface"), key=lambda p: int(p.parent.name[5:]))
    if returncode == 0 and ALGOS[run.algo].keeps_model and exports:
        exports[-1].rename(run.out_dir / "model")  # the last step's Hugging Face export
    shutil.rmtree(run.out_dir / "checkpoints", ignore_errors=True)
    record = {"table": run.table, "task": run.task, "algo": run.algo, "seed": run.seed, "steps": run.steps,
              "machine": machine_record(), "command": " ".join(command[1:]).replace(str(REPO) + "/", ""),
              "returncode": returncode,
              "started": started, "wall_s": round(wall, 1), "cpu_s_rusage_children": round(rusage_cpu, 1),
              "cpu_s_tree_sampled": round(sampler.cpu_s, 1), "cpu_s": round(max(rusage_cpu, sampler.cpu_s), 1),
              "loadavg_1min": {"min": min(sampler.loads, default=0), "max": max(sampler.loads, default=0),
                               "mean": round(sum(sampler.loads) / max(1, len(sampler.loads)), 2)}}
    run.out_dir.mkdir(parents=True, exist_ok=True)
    (run.out_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def finished(run: Run) -> bool:
    path = run.out_dir / "run.json"
    kept = not ALGOS[run.algo].keeps_model or (run.out_dir / "model" / "config.json").is_file()
    return path.is_file() and json.loads(path.read_text()).get("returncode") == 0 and \
        json.loads(path.read_text()).get("steps") == run.steps and kept


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--only", nargs="*", default=[], help="table, table:algo or table:algo:seed (default: all)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--steps", nargs="*", default=[], help="per-table step count, e.g. b=20 (default 40)")
    parser.add_argument("--rerun", action="store_true", help="run again even when run.json says it finished")
    parser.add_argument("--list", action="store_true", help="print the commands and stop")
    parser.add_argument("--no-summary", action="store_true", help="do not rewrite README tables and plots")
    args = parser.parse_args(argv)
    unknown = [entry for entry in args.only if entry.split(":")[0] not in TABLES]
    if unknown:
        parser.error(f"--only {unknown}: tables are {sorted(TABLES)}")
    steps = {table: int(value) for table, value in (entry.split("=") for entry in args.steps)}
    runs = plan(args.only, tuple(args.seeds), steps)
    if any(ALGOS[run.algo].needs_teacher for run in runs):
        runs.insert(0, TEACHER_RUN)  # skipped when its model is there; made first when it is not
    if args.list:
        for run in runs:
            print(" ".join(run.command()[1:]).replace(str(REPO) + "/", ""))
        return 0
    for task in sorted({run.task for run in runs}):
        write_task(task, HERE / "runs" / task / "data")
    for index, run in enumerate(runs, start=1):
        if finished(run) and not args.rerun:
            print(f"[{index}/{len(runs)}] {run.task}/{run.algo}/seed{run.seed}: done before, skipped", flush=True)
            continue
        print(f"[{index}/{len(runs)}] {run.task}/{run.algo}/seed{run.seed} ...", flush=True)
        record = execute(run)
        print(f"    rc={record['returncode']} wall {record['wall_s']} s, cpu {record['cpu_s']} s, "
              f"load {record['loadavg_1min']}", flush=True)
        if run is TEACHER_RUN and not finished(run):
            sys.exit(f"the teacher run failed (rc={record['returncode']}; no {TEACHER_MODEL}): see its train.log "
                     f"under {run.out_dir}")
    if not args.no_summary:
        from summarize import main as summarize

        summarize([])
    return 0


if __name__ == "__main__":
    sys.exit(main())
