"""A bounded pool of grading processes with a hard per-sample timeout.

`ProcessPoolExecutor` cannot stop a hung task and breaks when a worker dies, so this pool keeps a pipe per worker:
a task past its deadline has its worker SIGKILLed and replaced, a dead worker is replaced, the sample fails and the
batch carries on. Workers (grading_worker.py) grade on their main thread, where the math grader's CPU budget works.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron_cpo.rewards.sandbox_types import SandboxConfig

_STARTUP_TIMEOUT_S = 120.0
GradingTask = tuple[str, str, object, object]  # data_source, solution_str, ground_truth, extra_info


@dataclass
class TaskOutcome:
    """What happened to one task: ``status`` is ok, error, timeout or crashed; ``result`` the grader's dict if ok."""

    status: str
    result: dict | None
    message: str
    seconds: float


class _Worker:
    """One grading process: a fresh ``python -m megatron_cpo.rewards.grading_worker`` talking over a socket pair.

    A fresh interpreter (not fork/forkserver) keeps the worker independent of the trainer's ``__main__`` and threads:
    it imports only the graders (no torch), so a replacement starts quickly; forkserver children re-imported the
    trainer's ``__main__`` (torch) and took several seconds each.
    """

    def __init__(self, init_args: tuple) -> None:
        parent_end, child_end = socket.socketpair()
        environment = {**os.environ, "PYTHONPATH": os.pathsep.join(path for path in sys.path if path)}
        # Its own session: torchrun forwards a preemption SIGTERM to each rank's whole process group, and the rank
        # still grades the step it finishes before checkpointing. The worker exits when its socket closes.
        self.process = subprocess.Popen(
            [sys.executable, "-m", "megatron_cpo.rewards.grading_worker", str(child_end.fileno())],
            pass_fds=(child_end.fileno(),), env=environment, stdin=subprocess.DEVNULL, start_new_session=True)
        child_end.close()
        self.connection = Connection(parent_end.detach())
        self.connection.send(init_args)
        self.ready = False
        self.task_index: int | None = None
        self.deadline = 0.0
        self.started = 0.0

    def kill(self) -> None:
        self.process.kill()
        self.process.wait()
        self.connection.close()


class GraderPool:
    """``num_workers`` grading processes; ``run`` grades a batch and returns one ``TaskOutcome`` per task, in order."""

    def __init__(self, num_workers: int, custom_graders: dict[str, str], custom_reward_function: str | None,
                 grader_kwargs: dict[str, dict], memory_limit_mb: int | None = None,
                 sandbox_settings: SandboxConfig | None = None) -> None:
        self._init_args = (custom_graders, custom_reward_function, grader_kwargs, memory_limit_mb, sandbox_settings)
        self._workers = [_Worker(self._init_args) for _ in range(num_workers)]
        self.restarts = 0

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._init_args)
        self.restarts += 1

    def _mark_ready(self, worker: _Worker, readable: set) -> None:
        """Take a new worker's start-up message; a worker that dies while starting is a configuration error."""
        if worker.connection in readable:
            try:
                worker.ready = worker.connection.recv() == "ready"
                return
            except (EOFError, OSError):
                pass
        if worker.connection in readable:
            raise RuntimeError(f"a grading worker died while starting (exit code {worker.process.wait()}); "
                               "check that custom graders import cleanly in a fresh process")

    def run(self, tasks: list[GradingTask], timeout_s: float) -> list[TaskOutcome]:
        """Grade ``tasks``; each gets at most ``timeout_s`` seconds of wall time in a ready worker."""
        outcomes: list[TaskOutcome | None] = [None] * len(tasks)
        pending = list(range(len(tasks)))[::-1]
        while pending or any(worker.task_index is not None for worker in self._workers):
            for worker in self._workers:
                if worker.ready and worker.task_index is None and pending:
                    index = pending.pop()
                    worker.task_index, worker.started = index, time.monotonic()
                    worker.deadline = worker.started + timeout_s
                    worker.connection.send(tasks[index])
            watched = [worker for worker in self._workers if not worker.ready or worker.task_index is not None]
            deadlines = [worker.deadline for worker in watched if worker.task_index is not None]
            wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else _STARTUP_TIMEOUT_S
            readable = set(wait([worker.connection for worker in watched], wait_s))
            now = time.monotonic()
            for worker in watched:
                if not worker.ready:
                    self._mark_ready(worker, readable)
                    continue
                index, elapsed = worker.task_index, now - worker.started
                if worker.connection in readable:
                    try:
                        status, result, message = worker.connection.recv()
                        outcomes[index] = TaskOutcome(status, result, message, elapsed)
                        worker.task_index = None
                        continue
                    except (EOFError, OSError):
                        pass
                if worker.connection in readable:
                    code = worker.process.wait()
                    outcomes[index] = TaskOutcome("crashed", None, f"grading worker died (exit code {code})", elapsed)
                    self._replace(worker)
                elif now >= worker.deadline:
                    outcomes[index] = TaskOutcome("timeout", None, f"grader exceeded {timeout_s:g}s", elapsed)
                    self._replace(worker)
            if not readable and not deadlines:
                raise RuntimeError(f"grading workers did not start within {_STARTUP_TIMEOUT_S:g}s")
        return outcomes

    def close(self) -> None:
        """Stop every worker (politely, then by SIGKILL)."""
        for worker in self._workers:
            try:
                worker.connection.send(None)
            except (BrokenPipeError, OSError):
                pass
        for worker in self._workers:
            try:
                worker.process.wait(timeout=2.0)
            except subprocess.TimeoutExpired:
                worker.process.kill()
                worker.process.wait()
            worker.connection.close()
        self._workers = []

