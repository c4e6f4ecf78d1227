"""Scripted stand-ins for the rollout engines and environments of the episode-runner unit tests (the issue asks for
them: mask, log-prob and prefix checks with known token ids need an engine whose output is known). The engine
answers every n=1 request at once from a script; everything else the runner does (threads, timeouts, the chat
template of the tiny model's tokenizer, limits) is real."""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Callable

from megatron_cpo.envs.base import StepResult, TextEnvironment, user
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass
class ScriptedEngines:
    """`script(request, turn)` -> (sampled ids, finish_reason); log-prob of the k-th sampled id of a turn is
    -(turn + 1) - k / 100, so every log-prob says where it came from. `max_tokens` is honoured like an engine: the
    ids are cut and the finish reason becomes "length"."""
    script: Callable[[Request, int], tuple[list[int], str]]
    requests: list[Request] = field(default_factory=list)
    cancelled: int = 0
    _done: list[RolloutGroup] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        assert params.n == 1, "the runner sends one request per turn"
        request = Request(request_id, list(prompt_token_ids), params)
        turn = int(request_id.rsplit("|t", 1)[1])
        ids, reason = self.script(request, turn)
        if len(ids) > params.max_tokens:
            ids, reason = ids[:params.max_tokens], "length"
        logprobs = [-(turn + 1) - k / 100 for k in range(len(ids))]
        with self._lock:
            self.requests.append(request)
            self._done.append(RolloutGroup(request_id, list(prompt_token_ids),
                                           [RolloutSample(ids, logprobs, reason, reason == "length")]))

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        with self._lock:
            done, self._done = self._done, []
        if not done:
            raise TimeoutError("nothing finished")
        return done

    def cancel_all(self) -> int:
        with self._lock:
            dropped, self._done = len(self._done), []
        self.cancelled += 1
        return dropped


class CountdownEnvironment(TextEnvironment):
    """Answers each turn with "left <k>"; done after `turns` steps with reward 1 on the last; rewards 0.1 per step."""

    def __init__(self, turns: int = 3) -> None:
        self.turns, self.steps = turns, 0
        self.actions: list[str] = []

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        self.actions.append(action_text)
        if self.steps >= self.turns:
            return StepResult([], reward=1.0, done=True)
        return StepResult([user(f"left {self.turns - self.steps}")], reward=0.1)

    def score(self) -> float:
        return 0.0


class Flaky(TextEnvironment):
    """Raises on its first step, hangs (past the call timeout) on its second when asked to, answers otherwise."""

    def __init__(self, hang: bool = False) -> None:
        self.hang, self.steps = hang, 0
        self.release = threading.Event()

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        if self.steps == 1:
            raise RuntimeError("the game server is down")
        if self.steps == 2 and self.hang:
            self.release.wait(5)
        return StepResult([user("ok")], reward=0.5, done=self.steps >= 3)


class SlowFirst(TextEnvironment):
    """The first episode to step waits there until another episode has taken two more turns (a lock-step runner
    would wait for it instead, until the call timeout)."""
    others_done = threading.Event()
    blocking = threading.Lock()

    def __init__(self) -> None:
        self.steps = 0

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        if self.steps == 1 and SlowFirst.blocking.acquire(blocking=False):
            assert SlowFirst.others_done.wait(10)
        return StepResult([user("next")], done=self.steps >= 3)

    def score(self) -> float:
        return 0.0


class SpellsEndOfTurn(TextEnvironment):
    def step(self, action_text: str) -> StepResult:
        return StepResult([], done=True)


class HeldUntilReleased(TextEnvironment):
    """One game: the row with `extra_info["held"]` waits in its first step until `release` is set (the test's way of
    keeping its episodes in flight when the batch fills); every episode ends after its second step."""
    release = threading.Event()

    def __init__(self) -> None:
        self.steps, self.held = 0, False

    def reset(self, record, seed):
        self.held = bool(record.extra_info.get("held"))
        return super().reset(record, seed)

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        if self.held and self.steps == 1:
            HeldUntilReleased.release.wait(30)
        return StepResult([user("again")], done=self.steps >= 2)

    def score(self) -> float:
        return 0.0


class NonFiniteRewards(TextEnvironment):
    """A game whose reward arithmetic goes wrong: NaN for the first step, +inf for the second (then done), and a
    final score of -inf."""

    def __init__(self) -> None:
        self.steps = 0

    def step(self, action_text: str) -> StepResult:
        self.steps += 1
        return StepResult([user("again")], reward=float("nan") if self.steps == 1 else float("inf"),
                          done=self.steps >= 2)

    def score(self) -> float:
        return float("-inf")
