"""`DaemonThreads`: the worker threads environment, tool and interaction calls run on.

`concurrent.futures.ThreadPoolExecutor` joins its threads when the interpreter exits, so one environment call that
never returns would keep the trainer from exiting after its timeout was long reported. These threads are daemons: a
hung call keeps its thread, never the process.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class DaemonThreads:
    """`size` daemon threads running submitted calls in order; `submit` returns a `Future` whose `started` attribute
    is the monotonic time the call began (None while it waits for a thread)."""

    def __init__(self, size: int, name: str) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._size = size
        for index in range(size):
            threading.Thread(target=self._work, name=f"{name}-{index}", daemon=True).start()

    def submit(self, function: Callable, *args: Any) -> Future:
        if self._closed:
            raise RuntimeError("these threads were shut down")
        future: Future = Future()
        future.started = None
        self._queue.put((future, function, args))
        return future

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            future, function, args = item
            if not future.set_running_or_notify_cancel():
                continue
            future.started = time.monotonic()
            try:
                future.set_result(function(*args))
            except BaseException as error:  # noqa: BLE001 - the caller reads it from the future
                future.set_exception(error)

    def shutdown(self) -> None:
        """Let each thread end once the calls queued before this one have run; later submits are refused."""
        if not self._closed:
            self._closed = True
            for _ in range(self._size):
                self._queue.put(None)
