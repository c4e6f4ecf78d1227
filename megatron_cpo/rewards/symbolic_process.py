"""The symbolic equivalence check for callers off the main thread, in a helper process that can be killed.

A ``compute_score`` call from another thread (an evaluation's thread pool, a web server) sends its symbolic check to
one shared helper grading process, where it runs on the main thread under the same CPU budget; a check past its
wall-clock allowance has its process replaced and counts as not equivalent.
"""
from __future__ import annotations

import atexit
import threading

from megatron_cpo.rewards.pool import GraderPool
from megatron_cpo.rewards.symbolic import SymbolicTimeout, symbolic_equal

SYMBOLIC_SOURCE = "megatron_cpo/symbolic-check"
_lock = threading.Lock()
_pool = None


def symbolic_check_grader(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None
                          ) -> dict:
    """Grader run inside the helper process: is the prediction ``solution_str`` symbolically equal to the truth?"""
    try:
        equal = symbolic_equal(solution_str, str(ground_truth), float((extra_info or {}).get("timeout_s", 5.0)))
    except SymbolicTimeout as timeout:
        return {"score": 0.0, "acc": False, "reason": str(timeout)}
    return {"score": float(equal), "acc": equal}


def _close() -> None:
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


def symbolic_equal_in_helper(prediction: str, ground_truth: str, timeout_s: float) -> tuple[bool, str]:
    """(equal, reason when not) from the helper process; its wall-clock allowance is ``3 * timeout_s + 5`` seconds
    (a loaded machine may make a check wait for a core)."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = GraderPool(1, {SYMBOLIC_SOURCE: f"{__name__}:symbolic_check_grader"}, None, {})
            atexit.register(_close)
        outcome = _pool.run([(SYMBOLIC_SOURCE, prediction, ground_truth, {"timeout_s": timeout_s})],
                            3 * timeout_s + 5)[0]
    if outcome.status != "ok":
        return False, f"symbolic check in the helper process: {outcome.message}"
    return bool(outcome.result["acc"]), outcome.result.get("reason", "")
