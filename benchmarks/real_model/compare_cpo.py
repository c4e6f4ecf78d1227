"""Does CPO pay? GRPO, DAPO, CPO (on DAPO) and CPO on GRPO on SmolLM2-135M at an equal budget of generated samples.

    nohup python benchmarks/real_model/compare_cpo.py > runs/compare_cpo/runner.log 2>&1 &   # all runs, in order
    python benchmarks/real_model/compare_cpo.py --list                                        # the commands only
    python benchmarks/real_model/compare_cpo_report.py                                        # curves, tables, docs
    python benchmarks/real_model/compare_cpo.py --arms opd opd_task opsd opsd_task            # on-policy distillation

The on-policy distillation arms (docs/distillation.md) train the base model towards a teacher at the same budget: `opd`
(k1 as a reward from the teacher's vLLM engine, verl's OPD script's signal), `opd_task` (plus the task reward), `opsd`
(the policy given the gold solution as its own teacher), `opsd_task` (plus the task reward), `opsd_task_c0.1_t0.7` (that
at GRPO's temperature 0.7 with the self teacher's term weighed 0.1); the teacher is `--teacher`, by default GRPO seed
1's final policy (`--arms grpo --seeds 1 --keep-model` makes it).

Every run is the example's config (`examples/smollm2-135m/{grpo,dapo,cpo,cpo_grpo}.yaml`) with the same budget: the
run ends after the step at which it has generated `--budget` samples (`trainer.total_rollout_samples`; every sample
counts, kept or dropped by filter-groups), and validates greedily on the same first 200 held-out questions before
training and after every `--val-every` samples (`trainer.test_freq_samples`). Runs go one at a time, seeds round-robin
over the arms (seed 1 of every arm first), so a comparison cut short stays balanced. Each run resumes
(`trainer.resume=auto`) from its checkpoint, written every `--save-freq` steps with only the newest kept, so a stopped
runner loses at most the steps since then: run the same command again. To pause the comparison, send the runner
SIGTERM (`kill <runner pid>`, or Ctrl-C): its trainer finishes the current step and checkpoints it, and no other run
starts; or create `runs/compare_cpo/PAUSE`: the runner finishes the run under way and starts no other (delete the
file before running the command again). A run whose `run.json` says it finished is read, not repeated; its
checkpoints are deleted then, and its `run.json`, `metrics.jsonl` and `step_cpu.jsonl` are copied to
`benchmarks/real_model/results/<comparison><budget>/<arm>/seed<k>/` (committed: the reports read it as a runs
directory, so seeds run on different machines and in different sessions pair up).

`--code DIR` runs the package and the example configs of DIR instead of this checkout's (a frozen copy, e.g.
`git archive HEAD | tar -x -C DIR`), so a comparison that takes a day runs one version of the code while the
checkout moves on; the model, the data and the runs stay here. Each run's directory `runs/compare_cpo/<arm>/seed<k>/`
holds the trainer's `metrics.jsonl` and `train.log`,
`console.log`, `step_cpu.jsonl` (per logged step: the CPU seconds of the whole process tree so far in that attempt,
trainer, Ray, vLLM engine and grading workers, sampled every second, and the wall seconds) and `run.json` (the
command, each attempt's exit code, wall and CPU seconds, load average and CPU: `machine`).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "learning"))

from run_table import TreeCpuSampler, machine_record  # noqa: E402

RUNS = REPO / "runs" / "compare_cpo"
# finished runs' records, committed: `runs/` is not, and a new machine starts without it (see `archive`)
RESULTS = HERE / "results"
ARCHIVED = ("run.json", "metrics.jsonl", "step_cpu.jsonl")
MODEL = REPO / "examples" / "smollm2-135m" / "model"
ARMS = {"grpo": "grpo.yaml", "dapo": "dapo.yaml", "cpo": "cpo.yaml", "cpo_grpo": "cpo_grpo.yaml",
        "opd": "grpo.yaml", "opd_task": "grpo.yaml", "opsd": "grpo.yaml", "opsd_task": "grpo.yaml",
        "opsd_task_c0.1_t0.7": "grpo.yaml"}
CPO_ARMS = ("grpo", "dapo", "cpo", "cpo_grpo")  # the default: the CPO comparison (docs/cpo.md)
TEACHER = RUNS / "grpo" / "seed1" / "model"  # the OPD arms' teacher: GRPO seed 1's final policy (--keep-model)
HINT_INSTRUCTION = "Please refer to the above solution and end your answer with the sum."  # cpo_grpo.yaml's
# On-policy distillation (docs/distillation.md) on GRPO's config, sampling at temperature 1 (the teacher scores at 1,
# so D is the reverse KL of the sampled distributions): OPD from the teacher's engine (k1 as a reward, verl's
# script), the same plus the task reward, and on-policy self-distillation (the policy given the gold solution), with
# and without the task reward.
OPD_K1 = ("distillation.enabled=true", "distillation.nnodes=0", "distillation.distillation_loss.loss_mode=k1",
          "distillation.distillation_loss.use_policy_gradient=true", "actor_rollout_ref.rollout.temperature=1.0")
OPD_ARMS = {
    "opd": (*OPD_K1, "distillation.distillation_loss.use_task_rewards=false"),
    "opd_task": (*OPD_K1, "distillation.distillation_loss.use_task_rewards=true"),
    "opsd": (*OPD_K1, "distillation.distillation_loss.use_task_rewards=false",
             "distillation.teacher_models.teacher_model.kind=self", f"data.hint_instruction={HINT_INSTRUCTION}"),
    "opsd_task": (*OPD_K1, "distillation.distillation_loss.use_task_rewards=true",
                  "distillation.teacher_models.teacher_model.kind=self", f"data.hint_instruction={HINT_INSTRUCTION}"),
}
# opsd_task stalled at 640 samples (docs/distillation.md): at temperature 1 the base model gets almost no training
# question right, so the self teacher's reward was the step's signal. This arm keeps GRPO's temperature 0.7 (where the
# task reward has right answers to work with) and weighs the self teacher's term at 0.1 of the task's.
OPD_ARMS["opsd_task_c0.1_t0.7"] = (
    *(override for override in OPD_ARMS["opsd_task"] if "rollout.temperature=" not in override),
    "actor_rollout_ref.rollout.temperature=0.7", "distillation.distillation_loss.distillation_loss_coef=0.1")
SEEDS = (1, 2, 3)
BUDGET, VAL_EVERY, VAL_QUESTIONS, SAVE_FREQ = 2560, 320, 200, 5
RESUMED = re.compile(r"resumed from .* \(step (\d+)\)")  # the checkpoint manager's line
SAMPLES_PER_STEP = 64  # train_batch_size 8 x rollout.n 8: the fewest a step generates, so budget / 64 caps the steps


@dataclass(frozen=True)
class Comparison:
    """What a comparison runs: its `arms` (arm -> example config of examples/smollm2-135m/, with `overrides` where an
    arm changes keys of it) and where its runs go (`runs`: `<arm>/seed<k>/`, the data in `data/`, the `PAUSE` file).
    compare_lora.py runs another one with this machinery."""
    name: str
    arms: dict[str, str]
    runs: Path
    default_arms: tuple[str, ...] = ()  # what runs without --arms (empty: every arm)
    overrides: dict[str, tuple[str, ...]] = field(default_factory=dict)  # arm -> its config's dotted overrides

    @property
    def pause(self) -> Path:
        return self.runs / "PAUSE"  # while it exists, no run starts


CPO = Comparison("compare_cpo", ARMS, RUNS, CPO_ARMS, overrides=OPD_ARMS)


def needs_teacher(overrides: tuple[str, ...]) -> bool:
    """Whether an arm's overrides distil from a teacher model (an engine), not from the policy itself."""
    return "distillation.enabled=true" in overrides and "distillation.teacher_models.teacher_model.kind=self" not in \
        overrides


@dataclass(frozen=True)
class Run:
    arm: str
    seed: int
    budget: int
    val_every: int
    save_freq: int
    code: Path = REPO
    comparison: Comparison = CPO
    model: Path = MODEL
    keep_model: bool = False  # keep the final policy as a Hugging Face directory, `<out_dir>/model` (a teacher)
    teacher: Path = TEACHER  # the OPD arms' teacher (a Hugging Face directory)

    @property
    def out_dir(self) -> Path:
        return self.comparison.runs / self.arm / f"seed{self.seed}"

    def command(self) -> list[str]:
        data = self.comparison.runs / "data"
        config = self.code / "examples" / "smollm2-135m" / self.comparison.arms[self.arm]
        return [sys.executable, "-m", "megatron_cpo.cli", "train", "--config", str(config),
                f"actor_rollout_ref.model.path={self.model}",
                f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                f"data.val_max_samples={VAL_QUESTIONS}", f"trainer.default_local_dir={self.out_dir}",
                "trainer.resume=auto", f"trainer.seed={self.seed}",
                f"trainer.total_training_steps={-(-self.budget // SAMPLES_PER_STEP)}",
                f"trainer.total_rollout_samples={self.budget}", f"trainer.test_freq_samples={self.val_every}",
                "trainer.test_freq=-1", "trainer.val_before_train=true", f"trainer.save_freq={self.save_freq}",
                "trainer.max_actor_ckpt_to_keep=1",
                "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra"
                + (",hf_model]" if self.keep_model else "]"),
                f"trainer.experiment_name={self.comparison.name}_{self.arm}_seed{self.seed}",
                "trainer.logger=[console,jsonl]", "actor_rollout_ref.rollout.ray_address=local", *self.overrides()]

    def overrides(self) -> tuple[str, ...]:
        """The arm's own overrides (`Comparison.overrides`), with the teacher engine's path for a distillation arm
        that has one."""
        overrides = self.comparison.overrides.get(self.arm, ())
        if needs_teacher(overrides):
            overrides = (*overrides, f"distillation.teacher_models.teacher_model.model_path={self.teacher}")
        return overrides


def plan(arms: list[str], seeds: list[int], budget: int, val_every: int, save_freq: int, code: Path = REPO,
         comparison: Comparison = CPO, model: Path = MODEL, keep_model: bool = False,
         teacher: Path = TEACHER) -> list[Run]:
    """Seed-major: seed 1 of every arm, then seed 2, ..."""
    return [Run(arm, seed, budget, val_every, save_freq, code, comparison, model, keep_model, teacher)
            for seed in seeds for arm in arms]


def read_record(run: Run) -> dict:
    path = run.out_dir / "run.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def finished(run: Run) -> bool:
    record = read_record(run)
    return bool(record.get("finished")) and record.get("budget") == run.budget


class NewLines:
    """The complete lines a growing file has gained since the last call (none before the file exists). A file found
    shorter than what was read is read on from its new end: a resumed trainer rewrites `metrics.jsonl` without the
    rows an earlier attempt logged past the checkpoint, at start-up, a step before it logs a new row."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, path.stat().st_size if path.is_file() else 0

    def read(self) -> list[str]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as file:
            self.offset = min(self.offset, os.fstat(file.fileno()).st_size)  # the file opened, not a later one
            file.seek(self.offset)
            data = file.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        return complete.decode(errors="replace").splitlines()


class StepCpuLog(threading.Thread):
    """Appends to `step_cpu.jsonl`, for every step row the trainer adds to `metrics.jsonl`, the tree's CPU seconds
    (`sampler.cpu_s`) and the wall seconds since this attempt started; and, when a resumed attempt's trainer logs
    "resumed from ... (step k)", a row `{"resumed": k, ...}` with the tree's CPU seconds then, so that the start-up of
    a resumed attempt (Ray, the engines, the model, the checkpoint) is not counted as its first step's work."""

    def __init__(self, run: Run, sampler: TreeCpuSampler, attempt: int) -> None:
        super().__init__(daemon=True)
        self.metrics, self.console = NewLines(run.out_dir / "metrics.jsonl"), NewLines(run.out_dir / "console.log")
        self.out = run.out_dir / "step_cpu.jsonl"
        self.sampler, self.attempt, self.started = sampler, attempt, time.perf_counter()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(1.0):
            self.poll()
        self.poll()

    def poll(self) -> None:
        entries = [{"resumed": int(match.group(1))} for line in self.console.read()
                   if (match := RESUMED.search(line))]
        entries += [{"step": row["step"]} for row in map(json.loads, filter(str.strip, self.metrics.read()))
                    if "step" in row]
        if entries:
            peak = trainer_peak_rss_gib(self.sampler.pid)
            with self.out.open("a") as out:
                for entry in entries:
                    out.write(json.dumps({**entry, "attempt": self.attempt, "tree_cpu_s": round(self.sampler.cpu_s, 2),
                                          "wall_s": round(time.perf_counter() - self.started, 2),
                                          "trainer_peak_rss_gib": peak}) + "\n")


def trainer_peak_rss_gib(pid: int) -> float | None:
    """The trainer process's peak resident memory so far (VmHWM: its own, not Ray's or the engine's; rank 0's
    Megatron model, optimizer and activations, and its data and grading clients); None where /proc lacks it."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 2**20, 3)
    except OSError:
        pass
    return None


class StopRequest:
    """SIGTERM or SIGINT to the runner: the running trainer gets SIGTERM (it finishes its step, checkpoints and
    exits), the runner records that attempt and starts no other run. Run the same command again to go on."""

    def __init__(self) -> None:
        self.requested, self.process = False, None
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum, frame) -> None:
        self.requested = True
        print(f"runner: signal {signum}: the running trainer finishes its step and checkpoints; no further run "
              "starts", flush=True)
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)


def execute(run: Run, stop: StopRequest | None = None) -> dict:
    """One attempt at a run (a resume when it has a checkpoint); returns its updated run.json record."""
    run.out_dir.mkdir(parents=True, exist_ok=True)
    record = read_record(run) or {"arm": run.arm, "seed": run.seed, "budget": run.budget, "attempts": []}
    command = run.command()
    # PYTHONSAFEPATH: `python -m` would otherwise put the working directory (this checkout) before PYTHONPATH, and
    # the run (and every process it starts) would import this checkout's package instead of --code's
    env = {**os.environ, "PYTHONPATH": str(run.code), "PYTHONSAFEPATH": "1"}
    env.pop("RAY_ADDRESS", None)
    started, start_wall = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), time.perf_counter()
    with (run.out_dir / "console.log").open("a") as log:
        log.write(f"\n== {started} {' '.join(command)}\n")
        log.flush()
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        if stop is not None:
            stop.process = process
        sampler = TreeCpuSampler(process.pid)
        steps = StepCpuLog(run, sampler, len(record["attempts"]))
        sampler.start()
        steps.start()
        returncode = process.wait()
    sampler.done.set()
    sampler.join()
    steps.done.set()
    steps.join()
    last = last_row(run.out_dir / "metrics.jsonl")
    generated = last.get("train/generated_samples", 0.0)
    record["command"] = " ".join(command[1:]).replace(str(REPO) + "/", "")
    record["code"] = str(run.code)
    record["attempts"].append({"started": started, "returncode": returncode,
                               "wall_s": round(time.perf_counter() - start_wall, 1),
                               "cpu_s_tree_sampled": round(sampler.cpu_s, 1), "last_step": last.get("step"),
                               "generated_samples": generated, "machine": machine_record(),
                               "loadavg_1min": {"min": min(sampler.loads, default=0),
                                                "max": max(sampler.loads, default=0),
                                                "mean": round(sum(sampler.loads) / max(1, len(sampler.loads)), 2)}})
    record["finished"] = returncode == 0 and generated >= run.budget and "val/acc" in last
    (run.out_dir / "run.json").write_text(json.dumps(record, indent=1) + "\n")
    if record["finished"]:
        archive(run)
        exports = sorted((run.out_dir / "checkpoints").glob("step_*/huggingface"))
        if run.keep_model and exports:
            shutil.rmtree(run.out_dir / "model", ignore_errors=True)
            exports[-1].rename(run.out_dir / "model")
        shutil.rmtree(run.out_dir / "checkpoints", ignore_errors=True)
    return record


def archive(run: Run, results: Path = RESULTS) -> Path:
    """Copy a finished run's record, metrics and per-step CPU (`ARCHIVED`, a few KB each) to
    `<results>/<comparison><budget>/<arm>/seed<k>/`, committed with the docs that quote them, so that the reports can
    pair seeds measured on different machines (each attempt's `machine` says which CPU) after `runs/` is gone."""
    target = results / f"{run.comparison.name}{run.budget}" / run.arm / f"seed{run.seed}"
    target.mkdir(parents=True, exist_ok=True)
    for name in ARCHIVED:
        if (run.out_dir / name).is_file():
            shutil.copyfile(run.out_dir / name, target / name)
    return target


def read_rows(path: Path) -> dict[int, dict]:
    """A run's metrics by step, in step order, each merged over the lines logged for it ({} without the file)."""
    rows: dict[int, dict] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                rows.setdefault(int(row["step"]), {}).update(row)
    return dict(sorted(rows.items()))


def last_row(path: Path) -> dict:
    """The last logged step's metrics, merged over the lines logged for it."""
    rows = read_rows(path)
    return rows[max(rows)] if rows else {}


def main(argv: list[str] | None = None, comparison: Comparison = CPO, description: str = __doc__) -> int:
    parser = argparse.ArgumentParser(description=description.strip().splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(comparison.default_arms or comparison.arms),
                        choices=list(comparison.arms),
                        help="default: " + " ".join(comparison.default_arms or comparison.arms)
                        + ("; opd, opd_task, opsd: on-policy distillation" if "opd" in comparison.arms else ""))
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--budget", type=int, default=BUDGET, help="generated samples per run")
    parser.add_argument("--val-every", type=int, default=VAL_EVERY, help="validate after every this many samples")
    parser.add_argument("--save-freq", type=int, default=SAVE_FREQ, help="checkpoint every this many steps")
    parser.add_argument("--code", type=Path, default=REPO, help="the package and example configs to run (a frozen "
                        "copy of the repository; default: this checkout)")
    parser.add_argument("--model", type=Path, default=MODEL, help="the model every arm starts from (default: "
                        "SmolLM2-135M-Instruct; a tiny model for a smoke run)")
    parser.add_argument("--runs", type=Path, default=comparison.runs, help="where the runs go (default: "
                        f"{comparison.runs.relative_to(REPO)}; another folder for a smoke run)")
    parser.add_argument("--keep-model", action="store_true", help="keep each finished run's final policy as a "
                        "Hugging Face directory, <runs>/<arm>/seed<k>/model (e.g. a distillation teacher)")
    parser.add_argument("--teacher", type=Path, default=TEACHER, help="the opd arms' teacher, a Hugging Face "
                        "directory (default: GRPO seed 1's final policy, kept with --keep-model)")
    parser.add_argument("--list", action="store_true", help="print the commands and stop")
    args = parser.parse_args(argv)
    comparison = replace(comparison, runs=args.runs.absolute())
    runs = plan(args.arms, args.seeds, args.budget, args.val_every, args.save_freq, args.code.resolve(), comparison,
                args.model.absolute(), args.keep_model, args.teacher.resolve())
    if args.list:
        for run in runs:
            print(" ".join(run.command()[1:]).replace(str(REPO) + "/", ""))
        return 0
    if not (args.model / "config.json").is_file():
        sys.exit(f"error: no model at {args.model}; fetch it once with python tools/fetch_smollm2.py")
    if any(needs_teacher(comparison.overrides.get(arm, ())) for arm in args.arms) and not (
            args.teacher / "config.json").is_file():
        sys.exit(f"error: no teacher at {args.teacher}; make it with python benchmarks/real_model/compare_cpo.py "
                 "--arms grpo --seeds 1 --keep-model, or pass --teacher <HF dir>")
    if not (args.code / "megatron_cpo" / "__init__.py").is_file():
        sys.exit(f"error: --code {args.code} holds no megatron_cpo package; "
                 "make one with git archive HEAD | tar -x -C DIR")
    if not (comparison.runs / "data" / "test.parquet").is_file():
        subprocess.run([sys.executable, "-m", "megatron_cpo.data.addition", "--out", str(comparison.runs / "data")],
                       cwd=REPO, check=True)
    failed, stop = [], StopRequest()
    for index, run in enumerate(runs, start=1):
        name = f"[{index}/{len(runs)}] {run.arm}/seed{run.seed}"
        if finished(run):
            print(f"{name}: finished before, read", flush=True)
            continue
        if stop.requested or comparison.pause.exists():
            why = f"{comparison.pause} exists" if comparison.pause.exists() else "stopped by a signal"
            failed.append(f"{run.arm}/seed{run.seed} (not started: {why})")
            continue
        print(f"{name} ... ({time.strftime('%H:%M:%S')})", flush=True)
        record = execute(run, stop)
        attempt = record["attempts"][-1]
        print(f"    rc={attempt['returncode']} finished={record['finished']} steps={attempt['last_step']} samples="
              f"{attempt['generated_samples']:.0f} wall {attempt['wall_s']} s, tree cpu {attempt['cpu_s_tree_sampled']}"
              f" s, load {attempt['loadavg_1min']}", flush=True)
        if not record["finished"]:
            failed.append(f"{run.arm}/seed{run.seed} (see {run.out_dir / 'console.log'})")
    if failed:
        print("not finished (run the same command again to resume them): " + ", ".join(failed), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
