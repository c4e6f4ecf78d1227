"""Runs that are killed, lose engines, find damaged checkpoints or an earlier run: nothing is lost, nothing repeated,
nothing mixed, and no process outlives the run.

Real runs of the tiny GRPO example (examples/tiny/grpo_arith.yaml, shrunk by the session's overrides): as
`python -m megatron_cpo.trainer` subprocesses where the case is about processes (killed engine workers, SIGTERM
during start-up), in-process on the session's engine where it is about files (damaged checkpoints,
an earlier run in the output directory).
"""
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from megatron_cpo.config import ConfigError, load_config
from megatron_cpo.trainer.assemble import run_training
from megatron_cpo.trainer.run.checkpoint_files import CheckpointError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny" / "grpo_arith.yaml"


pytestmark = pytest.mark.usefixtures("restore_environment")


def logged_steps(run_dir: Path) -> list[int]:
    """The step of every complete row of metrics.jsonl, in file order."""
    path = run_dir / "metrics.jsonl"
    steps = []
    for line in (path.read_text().splitlines() if path.is_file() else []):
        try:
            steps.append(json.loads(line)["step"])
        except ValueError:  # the row being written right now
            pass
    return steps


def rows(run_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


def latest(run_dir: Path) -> str:
    return (run_dir / "checkpoints" / "latest").read_text().strip()


def error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error:")]


class TrainProcess:
    """`python -m megatron_cpo.trainer` in a session of its own; remembers every process it started (Ray's and the
    engines' included), so the test can check that none outlives it and clean up after a failure."""

    def __init__(self, overrides: list[str], log_dir: Path, env: dict[str, str] | None = None) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self.stdout, self.stderr = log_dir / "stdout.log", log_dir / "stderr.log"
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "megatron_cpo.trainer", "--config", str(EXAMPLE),
                                          *overrides], cwd=REPO, stdout=out, stderr=err, start_new_session=True,
                                         env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
        self.seen: dict[int, psutil.Process] = {}

    @classmethod
    def pausing(cls, overrides: list[str], log_dir: Path, run_dir: Path, after_steps: tuple[int, ...]
                ) -> "TrainProcess":
        """A run whose grader waits for `resume_rollout(S)` during the rollout of step S + 1, for each S in
        `after_steps` (tests/trainer/graders.py: even_first_character_pausing)."""
        grader = "reward.custom_reward_function=tests.trainer.graders:even_first_character_pausing"
        return cls([*overrides, grader, "reward.timeout_s=150"], log_dir,
                   {"PAUSE_DIR": str(log_dir), "PAUSE_RUN_DIR": str(run_dir),
                    "PAUSE_AFTER_STEPS": ",".join(map(str, after_steps))})

    def wait_until_paused(self, after_step: int) -> None:
        self.wait_for((self.log_dir / f"paused_{after_step}").exists, f"the pause after step {after_step}")

    def resume_rollout(self, after_step: int) -> None:
        (self.log_dir / f"go_{after_step}").touch()

    def descendants(self) -> list[psutil.Process]:
        try:
            found = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        for process in found:
            self.seen.setdefault(process.pid, process)
        return found

    def engine_workers(self) -> list[psutil.Process]:
        """vLLM's engine-core processes (one per engine), children of the engines' Ray actors."""
        def is_core(process: psutil.Process) -> bool:
            try:
                return "EngineCore" in process.name() + " ".join(process.cmdline())
            except psutil.Error:
                return False
        return [process for process in self.descendants() if is_core(process)]

    def wait_for(self, condition, what: str, timeout: float = 420.0) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            self.descendants()
            if self.proc.poll() is not None:
                raise AssertionError(f"the run exited (rc {self.proc.returncode}) before {what}:\n"
                                     f"{self.stderr.read_text()[-3000:]}")
            assert time.monotonic() < deadline, f"timed out waiting for {what}:\n{self.stderr.read_text()[-3000:]}"
            time.sleep(0.1)

    def wait_exit(self, timeout: float = 300.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            self.descendants()
            assert time.monotonic() < deadline, f"the run did not exit:\n{self.stderr.read_text()[-3000:]}"
            time.sleep(0.1)
        return self.proc.returncode

    def still_running(self, grace_s: float) -> list[str]:
        """The processes this run started that are still running `grace_s` seconds from now (at most)."""
        _, alive = psutil.wait_procs([p for p in self.seen.values() if p.is_running()], timeout=grace_s)
        return [f"{p.pid} {p.name()}" for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]

    def kill_all(self) -> None:
        """kill -9 of the whole job: the trainer and every process it started (as a node failure would)."""
        self.descendants()
        for process in [psutil.Process(self.proc.pid) if self.proc.poll() is None else None, *self.seen.values()]:
            try:
                if process is not None:
                    process.kill()
            except psutil.Error:
                pass
        self.proc.wait(timeout=60)
        psutil.wait_procs(list(self.seen.values()), timeout=30)


def test_dead_engines_lose_and_repeat_no_step(small_run_overrides, rollout_manager, tmp_path):
    """Two attempts at one 5-step run (save_freq=2), as the issue's repros:
    1. a job with two engines: one engine's worker is killed during step 2's rollout (the run goes on with the
       other: logged once, counted in rollout/engines_alive), then the other's during step 4's rollout: the run
       checkpoints what it trained (step 3, or 4 when the death is noticed only at the weight sync after step 4's
       update) and exits with one line naming that engine and the fix, leaving no process behind;
    2. resume=auto on the session's engine: to step 5, which is checkpointed although 2 does not divide 5.
    metrics.jsonl then reads every step once. (A job killed with -9, whose resume drops the rows logged after its
    checkpoint: test_async_resume.py and test_multi_turn_e2e.py.)"""
    run_dir = tmp_path / "run"
    run = [*small_run_overrides, "trainer.total_training_steps=5", "trainer.save_freq=2",
           "trainer.val_before_train=true"]
    job = TrainProcess.pausing([*run, "actor_rollout_ref.rollout.ray_address=local",
                                "actor_rollout_ref.rollout.num_engines=2"], tmp_path / "job", run_dir,
                               after_steps=(1, 3))
    try:
        job.wait_until_paused(after_step=1)
        workers = job.engine_workers()
        assert len(workers) == 2, workers
        workers[0].kill()
        job.resume_rollout(after_step=1)
        job.wait_until_paused(after_step=3)
        assert logged_steps(run_dir) == [0, 1, 2, 3] and latest(run_dir) == "step_000002"
        workers = job.engine_workers()
        assert len(workers) == 1, workers
        workers[0].kill()
        job.resume_rollout(after_step=3)
        returncode = job.wait_exit()
        stray = job.still_running(grace_s=30)
    finally:
        job.kill_all()
    stderr = job.stderr.read_text()
    assert returncode == 1, stderr[-3000:]
    [first_death] = re.findall(r"engine (\d) \(.*\) died; 1 of 2 engines left", stderr)
    trained = max(logged_steps(run_dir))
    assert trained in (3, 4) and logged_steps(run_dir) == list(range(trained + 1))
    assert [rows(run_dir)[step]["rollout/engines_alive"] for step in (1, 2, 3)] == [2.0, 1.0, 1.0]
    assert latest(run_dir) == f"step_{trained:06d}"
    [error] = error_lines(stderr)
    assert f"engine {1 - int(first_death)}" in error and f"step_{trained:06d}" in error, error
    assert "trainer.resume=auto" in error, error
    assert stray == [], stderr[-3000:]

    run_training(load_config(EXAMPLE, [*run, "trainer.resume=auto"]), rollout_manager)
    assert logged_steps(run_dir) == [0, 1, 2, 3, 4, 5]
    assert "val/acc" in rows(run_dir)[0] and "val/acc" in rows(run_dir)[5]
    assert latest(run_dir) == "step_000005"
    assert (run_dir / "checkpoints" / "step_000005" / "huggingface" / "config.json").is_file()
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [
        "latest", *sorted({"step_000002", f"step_{trained:06d}", "step_000004", "step_000005"})]


def test_damaged_checkpoints_fall_back_or_stop_naming_the_file_and_runs_never_mix(make_config, rollout_manager,
                                                                                  tmp_path, caplog):
    """A 2-step run saves steps 1 and 2 (atomically, with a manifest). Then: a truncated rank file, `latest` with
    garbage, `latest` naming a deleted step each fall back to the newest intact checkpoint with a warning naming
    the problem; with nothing intact the run stops naming the file. resume=disable into the directory is refused in
    one line; trainer.overwrite=true archives the earlier run and the new one (save_freq=-1) still ends with a
    checkpoint of its last step."""
    run_dir = tmp_path / "run"
    checkpoints = run_dir / "checkpoints"
    run = ("trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.val_before_train=false")
    run_training(make_config(*run), rollout_manager)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000001", "step_000002"]
    rank_file = checkpoints / "step_000002" / "rank_00000.pt"
    manifest = json.loads((checkpoints / "step_000002" / "manifest.json").read_text())
    assert manifest["world_size"] == 1 and manifest["files"]["rank_00000.pt"]["bytes"] == rank_file.stat().st_size
    assert logged_steps(run_dir) == [1, 2]
    resume = make_config(*run, "trainer.resume=auto")

    with rank_file.open("r+b") as file:
        file.truncate(rank_file.stat().st_size // 2)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_training(resume, rollout_manager)  # falls back to step 1 and trains step 2 again
    assert f"{rank_file} has" in caplog.text and "truncated" in caplog.text
    assert "instead: " in caplog.text and "step_000001" in caplog.text
    assert logged_steps(run_dir) == [1, 2] and latest(run_dir) == "step_000002"

    for marker, problem in ((b"\x00garbage\xff", "not a step directory name"),
                            (b"step_000009\n", "names step_000009, which does not exist")):
        (checkpoints / "latest").write_bytes(marker)
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            run_training(resume, rollout_manager)  # resumes from step 2, which already ends the run
        assert problem in caplog.text and "intact checkpoint" in caplog.text
        assert "already ends this run of 2 steps (raise trainer.total_training_steps to" in caplog.text
        assert logged_steps(run_dir) == [1, 2]

    for step in (1, 2):
        (checkpoints / f"step_{step:06d}" / "rank_00000.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="no intact checkpoint") as error:
        run_training(resume, rollout_manager)
    assert str(rank_file) in str(error.value) and "\n" not in str(error.value)

    with pytest.raises(ConfigError, match="holds an earlier run") as error:
        run_training(make_config(*run, "trainer.resume=disable"), rollout_manager)
    assert "trainer.overwrite=true" in str(error.value) and "\n" not in str(error.value)

    run_training(make_config("trainer.total_training_steps=1", "trainer.val_before_train=false",
                             "trainer.resume=disable", "trainer.overwrite=true"), rollout_manager)
    [archive] = tmp_path.glob("run.archived-*")
    assert logged_steps(archive) == [1, 2] and (archive / "checkpoints" / "step_000002").is_dir()
    assert logged_steps(run_dir) == [1] and latest(run_dir) == "step_000001"
    assert (checkpoints / "step_000001" / "huggingface" / "config.json").is_file()


@pytest.mark.engine  # a trainer subprocess that starts its engine
def test_sigterm_during_engine_start_exits_cleanly(small_run_overrides, tmp_path):
    """SIGTERM while the engine is starting: status 143, one error line, and every process the run started
    (Ray, the engine actor, vLLM's engine core) ends with it."""
    run = TrainProcess([*small_run_overrides, "actor_rollout_ref.rollout.ray_address=local"], tmp_path / "startup")
    try:
        run.wait_for(lambda: run.engine_workers(), "the engine's worker process")
        run.proc.send_signal(signal.SIGTERM)
        returncode = run.wait_exit(timeout=120)
        stray = run.still_running(grace_s=20)
    finally:
        run.kill_all()
    stderr = run.stderr.read_text()
    assert returncode == 143, stderr[-3000:]
    [error] = error_lines(stderr)
    assert "SIGTERM during start-up" in error
    assert stray == [], stderr[-3000:]
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_resumed_sinks_forget_what_an_earlier_attempt_logged_after_the_checkpoint(tmp_path):
    """An attempt logs steps 1-3 (and a completions row per step), dies; the next resumes from step 1's checkpoint
    and logs 2-3 again: each sink holds every step once, with the new values (JSONL cut back, TensorBoard purged)."""
    pytest.importorskip("tensorboard", reason="the tools extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron_cpo.trainer.driver.loggers import MetricLogger

    first = MetricLogger(["jsonl", "tensorboard"], tmp_path, 3, "project", "run", {})
    for step in (1, 2, 3):
        first.log({"reward/mean": float(step)}, step)
        first.log_table("completions", [{"completion": f"first {step}"}], step)
    first.close()
    with (tmp_path / "metrics.jsonl").open("a") as file:
        file.write('{"reward/mean": 4.0, "st')  # the row a kill cut short
    second = MetricLogger(["jsonl", "tensorboard"], tmp_path, 3, "project", "run", {}, resume_step=1)
    for step in (2, 3):
        second.log({"reward/mean": 10.0 * step}, step)
        second.log_table("completions", [{"completion": f"second {step}"}], step)
    second.close()

    assert [(row["step"], row["reward/mean"]) for row in map(json.loads, (tmp_path / "metrics.jsonl").open())] == [
        (1, 1.0), (2, 20.0), (3, 30.0)]
    assert [row["completion"] for row in map(json.loads, (tmp_path / "completions.jsonl").open())] == [
        "first 1", "second 2", "second 3"]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 1.0), (2, 20.0), (3, 30.0)]
