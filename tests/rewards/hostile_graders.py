"""User graders for the reward-manager tests, registered by dotted path like a user's own would be."""
import os
import signal
import time


def sleeps(data_source, solution_str, ground_truth, extra_info=None):
    """Hangs far past any reward timeout."""
    time.sleep(600)
    return {"score": 1.0, "acc": True}


def raises(data_source, solution_str, ground_truth, extra_info=None):
    """A grader bug."""
    raise RuntimeError(f"grader bug on {solution_str!r}")


def kills_worker(data_source, solution_str, ground_truth, extra_info=None):
    """Takes its worker process down with it."""
    os.kill(os.getpid(), signal.SIGKILL)


def exact_match(data_source, solution_str, ground_truth, extra_info=None):
    """1/0 exact string match, a typical user grader."""
    correct = solution_str.strip() == str(ground_truth).strip()
    return {"score": 1.0 if correct else 0.0, "acc": correct, "pred": solution_str.strip()}


def hogs_memory(data_source, solution_str, ground_truth, extra_info=None):
    """Asks for far more memory than a grading worker may have."""
    return {"score": float(len(bytearray(64 << 30))), "acc": True}


def nan_score(data_source, solution_str, ground_truth, extra_info=None):
    """A grader whose arithmetic went wrong (0/0 in floating point)."""
    return {"score": float("nan"), "acc": False}


def inf_score(data_source, solution_str, ground_truth, extra_info=None):
    """A grader that returns a bare infinite number."""
    return float("-inf")
