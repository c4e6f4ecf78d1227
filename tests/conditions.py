"""Condition waits for tests: poll what the test is waiting for until it holds or a deadline passes, instead of
sleeping a fixed time and hoping (too short on a loaded machine, wasted time on an idle one)."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(condition: Callable[[], T], timeout_s: float, what: str, interval_s: float = 0.05) -> T:
    """Call `condition` every `interval_s` seconds until it returns something truthy, and return that; raise
    TimeoutError naming `what` if it has not after `timeout_s` seconds."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"waited {timeout_s:g}s for {what}")
        time.sleep(interval_s)
