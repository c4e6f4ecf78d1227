"""Progress lines with an ETA, shared by the training console and `megatron-cpo eval`.

The ETA is the mean time per unit so far times the units left: crude, but it needs no model of the work, and on a
steady loop (training steps, prompts) it settles within a few units.
"""
from __future__ import annotations

import sys
import time
from typing import TextIO


def format_duration(seconds: float) -> str:
    """`42 s`, `3 min 05 s`, `1 h 02 min`: short enough for a progress line, exact enough to plan by."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


def eta_seconds(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the mean rate so far; None before the first unit is done."""
    if done <= 0:
        return None
    return max(total - done, 0) * elapsed / done


def bar(done: float, total: float, width: int = 20) -> str:
    """`[#####...............]` for the fraction done."""
    filled = int(width * min(max(done / max(total, 1), 0.0), 1.0))
    return "[" + "#" * filled + "." * (width - filled) + "]"


class ProgressLine:
    """Prints `label [bar] done/total unit, elapsed, ETA` to `stream` when a unit completes, at most once per
    `min_interval_s` (always for the last unit), so a long run shows it is alive without flooding a log."""

    def __init__(self, label: str, total: int, unit: str, stream: TextIO | None = None,
                 min_interval_s: float = 5.0) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.stream = stream if stream is not None else sys.stderr
        self.min_interval_s = min_interval_s
        self.start = time.perf_counter()
        self._last_print = -float("inf")

    def update(self, done: int) -> None:
        now = time.perf_counter()
        if done < self.total and now - self._last_print < self.min_interval_s:
            return
        self._last_print = now
        elapsed = now - self.start
        eta = eta_seconds(done, self.total, elapsed)
        tail = "done" if done >= self.total else f"ETA {format_duration(eta)}" if eta is not None else "ETA ?"
        print(f"{self.label} {bar(done, self.total)} {done}/{self.total} {self.unit}, {format_duration(elapsed)} "
              f"elapsed, {tail}", file=self.stream, flush=True)
