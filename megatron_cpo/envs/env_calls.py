"""Environment calls in flight: each runs on one of `multi_turn.env_workers` daemon threads (threads.py) and is given
`multi_turn.call_timeout_s`, counted from when it starts. The episode runner (runner.py) hands out the calls that are
done or late (`due`) and decides what each outcome means for its episode; this module only runs them, knows when
each is late, and closes every environment it made exactly once, whatever ends its episode: the final score call
closes it, and an abandoned episode's environment is closed now or once its running call returns (`release`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from megatron_cpo.envs.base import Message, StepResult
from megatron_cpo.envs.episode import Episode
from megatron_cpo.envs.threads import DaemonThreads

logger = logging.getLogger(__name__)


@dataclass
class Call:
    episode: Episode
    kind: str  # reset, step or finish


def as_step_result(value: Any) -> StepResult:
    """A `StepResult`, or Gym's (observation, reward, done, info) with a text or message-list observation."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 4:
        result = StepResult(value[0], float(value[1] or 0.0), bool(value[2]), dict(value[3] or {}))
    else:
        raise TypeError(f"step returned {type(value).__name__}; return a StepResult or (observation, reward, done, "
                        "info)")
    if isinstance(result.messages, str):
        result.messages = [{"role": "user", "content": result.messages}] if result.messages else []
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in result.messages):
        raise TypeError(f"step's observation {result.messages!r} is not a list of {{role, content}} messages")
    return result


def make_and_reset(make: Callable[[], Any], record: Any, seed: int) -> tuple[Any, list[Message]]:
    """A new environment and its first conversation; an environment whose reset raises is closed before the error
    goes on (it was made, so it is closed once)."""
    environment = make()
    try:
        messages = environment.reset(record, seed)
        return environment, [dict(message) for message in messages]
    except BaseException:
        quiet_close(environment)
        raise


def finish_environment(environment: Any) -> float | None:
    """The environment's final score, then close it (even when scoring fails)."""
    try:
        score = environment.score() if callable(getattr(environment, "score", None)) else None
        return None if score is None else float(score)
    finally:
        if callable(getattr(environment, "close", None)):
            environment.close()


def quiet_close(environment: Any) -> None:
    try:
        if callable(getattr(environment, "close", None)):
            environment.close()
    except Exception as err:  # noqa: BLE001 - closing an abandoned episode must not disturb the run
        logger.debug("closing an abandoned environment failed: %s", err)


def _timed(function: Callable, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return function(*args), time.perf_counter() - started


class EnvironmentCalls:
    """The calls in flight (`out`, by future). `on_done` is called (on the worker thread, or on the caller's when the
    call is already done) whenever one returns, so a waiting runner can look at it."""

    def __init__(self, workers: int, timeout_s: float, on_done: Callable[[], None]) -> None:
        self.pool = DaemonThreads(workers, "megatron-cpo-env")
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.out: dict[concurrent.futures.Future, Call] = {}

    def start(self, episode: Episode, kind: str, function: Callable, *args: Any) -> None:
        """Run `function(*args)` for `episode`; its result is (value, seconds). A `finish` call closes the
        environment, so the episode's environment counts as released from now on."""
        future = self.pool.submit(_timed, function, *args)
        self.out[future] = Call(episode, kind)
        episode.released = episode.released or kind == "finish"
        future.add_done_callback(lambda _: self.on_done())

    def due(self, now: float) -> list[tuple[concurrent.futures.Future, Call]]:
        """The calls that returned or are past their timeout, no longer in flight."""
        done = [future for future in self.out if future.done() or self._late(future, now)]
        return [(future, self.out.pop(future)) for future in done]

    def next_check(self, now: float) -> float | None:
        """Seconds until the earliest running call is late (a queued call has not started its clock: look again
        within one timeout); None when no call is out."""
        if not self.out:
            return None
        running = [future.started for future in self.out if future.started is not None]
        return max(0.0, min(running) + self.timeout_s - now) + 1e-3 if running else self.timeout_s

    def _late(self, future: concurrent.futures.Future, now: float) -> bool:
        """A call past its timeout (counted from when it started running)."""
        return future.started is not None and now - future.started > self.timeout_s

    def drop_all(self) -> dict[int, concurrent.futures.Future]:
        """Forget every call in flight (their results are never read); returns the running call of each episode by
        id(episode), for `release`."""
        busy = {id(call.episode): future for future, call in self.out.items()}
        self.out.clear()
        return busy

    def release(self, episode: Episode, busy: concurrent.futures.Future | None) -> None:
        """Close an abandoned episode's environment once: now, or once its running call (`busy`) returns; nothing
        when its close is done or arranged already (a final score call closes it)."""
        if episode.released:
            return
        episode.released = True
        environment = episode.env
        if busy is not None and environment is None:  # its reset is running: close what the reset returns
            busy.add_done_callback(lambda f: not f.cancelled() and f.exception() is None
                                   and self._close(f.result()[0][0]))
        elif environment is not None:
            if busy is None:
                self._close(environment)
            else:
                busy.add_done_callback(lambda _: self._close(environment))

    def _close(self, environment: Any) -> None:
        try:
            self.pool.submit(quiet_close, environment)
        except RuntimeError:  # the threads were shut down (the run is closing): close on this thread
            quiet_close(environment)

    def shutdown(self) -> None:
        self.pool.shutdown()
