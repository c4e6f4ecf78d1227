"""The emulated SLURM test's reward function: the real grader, held at the first training sample until the job has
been preempted, so the preemption SIGTERM deterministically arrives mid-step (after the rollout, before the rewards).

The trainer must then still grade, train, push weights and checkpoint that step; this also shows that the grading
workers survive the SIGTERM torchrun sends to each rank's whole process group.
"""
import os
import time
from pathlib import Path

from megatron_cpo.rewards.registry import compute_score


def grade_after_preemption(data_source, solution_str, ground_truth, extra_info=None):
    """Grade with the registered grader. Training samples first wait for `$LOG_DIR/preempted` (up to 300 s), and
    each graded one appends the grading worker's pid to `$LOG_DIR/graded-train` (a worker killed mid-sample by the
    SIGTERM would leave a line missing and a second pid)."""
    if (extra_info or {}).get("split") != "train":
        return compute_score(data_source, solution_str, ground_truth, extra_info)
    log_dir = Path(os.environ["LOG_DIR"])
    (log_dir / "grading-started").touch()
    deadline = time.monotonic() + 300
    while not (log_dir / "preempted").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # launch.sh marks `preempted` just before it sends SIGTERM down srun -> torchrun -> ranks
    result = compute_score(data_source, solution_str, ground_truth, extra_info)
    with open(log_dir / "graded-train", "a") as record:
        record.write(f"{os.getpid()}\n")
    return result
