"""The emulated SLURM test's reward function: the real grader, held at the first training sample until the job has
been preempted, so the preemption SIGTERM deterministically arrives mid-step (after the rollout, before the rewards).

The trainer must then still grade, train, push weights and checkpoint that step; this also shows that the grading
workers survive the SIGTERM torchrun sends to each rank's whole process group.
"""
import os
import time
from pathlib import Path

from megatron_cpo.rewards.registry import compute_score

SIGTERM_LOGGED = "SIGTERM received"  # what megatron_cpo.trainer.run.run_guards.StopSignal logs on each signalled rank


def _sigterms_logged(log_dir: Path) -> int:
    """How many times the trainer's log (launch.sh writes it to `$LOG_DIR/trainer.log`) says a rank got SIGTERM."""
    try:
        return (log_dir / "trainer.log").read_text(errors="replace").count(SIGTERM_LOGGED)
    except FileNotFoundError:
        return 0


def grade_after_preemption(data_source, solution_str, ground_truth, extra_info=None):
    """Grade with the registered grader. Training samples first wait (up to 300 s in all) for `$LOG_DIR/preempted`
    and then for the trainer to log the SIGTERM that follows it, and each graded one appends the grading worker's pid
    to `$LOG_DIR/graded-train` (a worker killed mid-sample by the SIGTERM would leave a line missing and a second
    pid)."""
    if (extra_info or {}).get("split") != "train":
        return compute_score(data_source, solution_str, ground_truth, extra_info)
    log_dir = Path(os.environ["LOG_DIR"])
    started = log_dir / "grading-started"  # holds the count of logged SIGTERMs before the first training sample
    if not started.exists():
        pending = log_dir / "grading-started.tmp"
        pending.write_text(str(_sigterms_logged(log_dir)))
        pending.replace(started)  # atomically: the test sends the preemption signal once this file exists
    signalled_before = int(started.read_text())
    deadline = time.monotonic() + 300
    while not (log_dir / "preempted").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    # launch.sh marks `preempted` just before it sends SIGTERM down srun -> torchrun -> ranks: hold the sample until
    # the trainer has logged that the signal arrived (rank 0's handler runs while it waits for this grader).
    while _sigterms_logged(log_dir) == signalled_before and time.monotonic() < deadline:
        time.sleep(0.2)
    result = compute_score(data_source, solution_str, ground_truth, extra_info)
    with open(log_dir / "graded-train", "a") as record:
        record.write(f"{os.getpid()}\n")
    return result
