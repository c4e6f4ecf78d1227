"""Symbolic equivalence of two LaTeX answers (HF math-verify, sympy based) under a CPU-time budget.

math-verify's wall-clock ``signal.alarm`` fires on checks that merely waited for a core on a loaded machine, so it
is off and a CPU-time timer (``ITIMER_PROF``) bounds the check instead. Signals reach only the main thread: off it,
callers go through ``symbolic_process``. A leaf module.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify


class SymbolicTimeout(BaseException):
    """The symbolic check used up its CPU-time budget.

    A ``BaseException`` (like ``KeyboardInterrupt``) because math-verify catches ``Exception`` around its parsing and
    comparison, which would turn the interrupt into an ordinary "not equal" and let the work continue.
    """


class _DropDisabledTimeoutWarning(logging.Filter):
    """math-verify warns when its own timeout is off; here the CPU-time budget replaces it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _logger_name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_logger_name).addFilter(_DropDisabledTimeoutWarning())


@contextmanager
def cpu_time_budget(seconds: float) -> Iterator[None]:
    """Raise ``SymbolicTimeout`` in the main thread once it has used ``seconds`` of CPU; no-op on other threads.

    The timer is one-shot, so an expiry racing with the ``finally`` below raises at most once and leaves nothing armed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise SymbolicTimeout(f"symbolic check exceeded {seconds:g} CPU seconds")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def symbolic_equal(prediction: str, ground_truth: str, timeout_s: float) -> bool:
    """math-verify equivalence of two LaTeX answers within a CPU-time budget of ``timeout_s`` (main thread); raises
    ``SymbolicTimeout`` when the budget runs out."""
    with cpu_time_budget(timeout_s):
        gold = mv_parse("\\boxed{" + ground_truth + "}", parsing_timeout=None)
        predicted = mv_parse("\\boxed{" + prediction + "}", parsing_timeout=None)
        if not gold or not predicted:
            return False
        return bool(mv_verify(gold, predicted, timeout_seconds=None))
