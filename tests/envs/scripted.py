"""Scripted stand-ins for the rollout engines and environments of the episode-runner unit tests (the issue asks for
them: mask, log-prob and prefix checks with known token ids need an engine whose output is known). The engine
answers every n=1 request at once from a script; everything else the runner does (threads, timeouts, the chat
template of the tiny model's tokenizer, limits) is real. The environments after `Counted` are also run by the
end-to-end tests (tests/trainer/test_multi_turn_e2e.py): they count what they make and close, say which of them
stepped an episode, misbehave, or pause a run where a test kills it."""
from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from megatron_cpo.envs.arith_retry import ArithmeticRetryEnvironment
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
    ids are cut and the finish reason becomes "length". Every sampled id carries `version`, the weight version the
    engines serve now (a test bumps it to play a weight push)."""
    script: Callable[[Request, int], tuple[list[int], str]]
    version: int = 0
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
                                           [RolloutSample(ids, logprobs, reason, reason == "length",
                                                          policy_versions=[self.version] * len(ids))]))

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


class Counted:
    """A mixin that counts the environments made and how often each was closed (class-wide: every environment must
    be closed exactly once, whatever ended its episode)."""
    made: list = []
    closes: dict[int, int] = {}
    lock = threading.Lock()

    @classmethod
    def reset_counts(cls) -> None:
        Counted.made, Counted.closes = [], {}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        with Counted.lock:
            Counted.made.append(self)
            Counted.closes[id(self)] = 0

    def close(self) -> None:
        with Counted.lock:
            Counted.closes[id(self)] += 1
        super().close()

    @classmethod
    def closed_once(cls, made: int | None = None) -> bool:
        """Every environment made was closed exactly once (and `made` of them were made, when given)."""
        with Counted.lock:
            return (made is None or len(Counted.made) == made) and all(c == 1 for c in Counted.closes.values())


class CountedHeld(Counted, HeldUntilReleased):
    pass


class CountedCountdown(Counted, CountdownEnvironment):
    pass


class HoldsFirstStep(Counted, TextEnvironment):
    """The first environment to step waits there until `release` is set; every step ends its episode."""
    release = threading.Event()
    taken = threading.Lock()

    def step(self, action_text: str) -> StepResult:
        if HoldsFirstStep.taken.acquire(blocking=False):
            HoldsFirstStep.release.wait(10)
        return StepResult([], reward=1.0, done=True)

    def score(self) -> float:
        return 0.0


class SlowScore(Counted, TextEnvironment):
    """Its final score takes until `release` is set (past any short call timeout)."""
    release = threading.Event()

    def step(self, action_text: str) -> StepResult:
        return StepResult([], reward=1.0, done=True)

    def score(self) -> float:
        SlowScore.release.wait(10)
        return 0.0


class Diverging(CountdownEnvironment):
    """Starts each episode from a conversation of its own (breaking the rule that a group starts from one)."""
    made = 0

    def reset(self, record, seed):
        Diverging.made += 1
        return [user(f"start {Diverging.made}")]


class NumberedRetry(Counted, ArithmeticRetryEnvironment):
    """`arith_retry` whose feedback names the environment and its step ("Wrong (env 7, step 1). Try again."), so an
    episode's text shows which environment stepped each of its turns, and in which order."""
    serial = itertools.count()

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.number = next(NumberedRetry.serial)

    def step(self, action_text: str) -> StepResult:
        result = super().step(action_text)
        if not result.done:
            result.messages = [user(f"Wrong (env {self.number}, step {self.attempts}). Try again.")]
        return result


class Misbehaving(Counted, ArithmeticRetryEnvironment):
    """`arith_retry` whose first step misbehaves by the row's index % 6: 0 raises, 1 returns text instead of a
    `StepResult`, 2 answers with a 200,000-character observation, 3 blocks until `release` is set (the first such
    environment to step only: one worker thread is held), 4 gives a NaN reward, and 5 behaves."""
    release = threading.Event()
    blocking = threading.Lock()

    def reset(self, record, seed):
        self.kind = record.index % 6
        return super().reset(record, seed)

    def step(self, action_text: str):
        if self.attempts == 0 and self.kind == 0:
            self.attempts += 1
            raise RuntimeError("the tool server is down")
        if self.attempts == 0 and self.kind == 1:
            self.attempts += 1
            return "not a StepResult"
        if self.attempts == 0 and self.kind == 2:
            self.attempts += 1
            return StepResult([user("x" * 200_000)])
        if self.attempts == 0 and self.kind == 3 and Misbehaving.blocking.acquire(blocking=False):
            Misbehaving.release.wait(600)
        if self.attempts == 0 and self.kind == 4:
            self.attempts += 1
            return StepResult([user(self.feedback)], reward=float("nan"))
        return super().step(action_text)


class GradedRetry(ArithmeticRetryEnvironment):
    """`arith_retry` without a score of its own: the run's grader grades each episode's last answer (so a run's
    custom reward function, e.g. tests/trainer/graders.py's pausing one, sees every episode)."""
    score = TextEnvironment.score


class PausingRetry(ArithmeticRetryEnvironment):
    """`arith_retry` with a cue point for tests that kill a run mid-episode: with $PAUSE_DIR set, once the run's
    metrics.jsonl ($PAUSE_RUN_DIR) holds step $PAUSE_AFTER_STEP, every step writes $PAUSE_DIR/paused and waits (at
    most 300 s) for $PAUSE_DIR/go, so the episodes in flight stop after a turn, their environments mid-way."""

    def step(self, action_text: str) -> StepResult:
        import json
        import os
        import time
        from pathlib import Path

        if os.environ.get("PAUSE_DIR"):
            pause_dir, metrics = Path(os.environ["PAUSE_DIR"]), Path(os.environ["PAUSE_RUN_DIR"]) / "metrics.jsonl"
            steps = set()
            for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
                try:
                    steps.add(json.loads(line)["step"])
                except ValueError:
                    pass
            if int(os.environ["PAUSE_AFTER_STEP"]) in steps:
                (pause_dir / "paused").touch()
                deadline = time.monotonic() + 300
                while not (pause_dir / "go").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)
        return super().step(action_text)


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
