"""One episode's state: its environment, the conversation, and the ids, loss mask, log-probs and weight versions
accumulated turn by turn (token in, token out). The runner (runner.py) drives it; everything here is bookkeeping.
Observation ids carry mask 0, log-prob 0 and the version of the sampled id before them (docs/multi_turn.md).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.envs.base import Message
from megatron_cpo.rollout.types import EpisodeInfo, RolloutSample, derive_sample_seeds

STOP_REASONS = ("done", "max_assistant_turns", "max_user_turns", "response_length", "turn_length",
                "observation_length", "env_timeout", "reset_error")
"""Why an episode ended (`multi_turn/stop/<reason>`); the length reasons flag it truncated."""
LENGTH_STOPS = frozenset({"response_length", "turn_length", "observation_length"})


def turn_seed(episode_seed: int | None, turn: int) -> int | None:
    """The engine seed of one turn of an episode: fixed by the episode's seed and the turn's number."""
    return None if episode_seed is None else derive_sample_seeds(episode_seed, turn + 1)[turn]


@dataclass
class Episode:
    """The state of the episode of sample `index` of a group."""
    request_id: str  # the group's
    index: int
    seed: int | None  # the episode's sampling seed (None: unseeded)
    budget: int
    agent: str = ""
    env: Any = None
    tools: list[dict] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] | None = field(default_factory=list)  # per response id; None: an engine did not say
    turn_rewards: list[float] = field(default_factory=list)
    assistant_turns: int = 0
    user_turns: int = 0
    stop_text: str = ""  # the text of the token the last turn stopped on
    finish_reason: str = "stop"
    stop_reason: str | None = None
    final_score: float | None = None
    tool_calls: Counter = field(default_factory=Counter)
    tool_failures: Counter = field(default_factory=Counter)
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0
    template_check: str = "off"
    non_finite_rewards: list[str] = field(default_factory=list)  # refused NaN / inf rewards (scored 0), described
    released: bool = False  # its environment's close is done or arranged (closed once, whatever ends the episode)

    @property
    def room(self) -> int:
        """Response tokens still free in the budget."""
        return self.budget - len(self.response_ids)

    def engine_request_id(self) -> str:
        return f"{self.request_id}|e{self.index}|t{self.assistant_turns}"

    def turn_tokens(self, per_turn_cap: int) -> int:
        """The next turn's max_tokens: what is left of the budget, at most `per_turn_cap` (0: no cap)."""
        return min(self.room, per_turn_cap) if per_turn_cap else self.room

    def add_turn(self, ids: list[int], logprobs: list[float], finish_reason: str,
                 versions: list[int] | None = None) -> None:
        """The engine's sampled ids, their log-probs and the weight version of each (`RolloutSample`'s), exactly as
        they came."""
        for name, values in (("log-probs", logprobs), ("weight versions", versions)):
            if values is not None and len(values) != len(ids):
                raise ValueError(f"{self.engine_request_id()}: {len(ids)} sampled ids but {len(values)} {name}")
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(value) for value in logprobs]
        self.versions = None if versions is None or self.versions is None else self.versions + list(versions)
        self.assistant_turns += 1
        self.finish_reason = finish_reason

    def add_observation(self, ids: list[int], messages: list[Message]) -> None:
        """An observation's ids (mask 0, log-prob 0, the version of the sampled id before them) and the messages
        they render."""
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        if self.versions is not None:
            self.versions += self.versions[-1:] * len(ids)
        self.messages += messages
        self.user_turns += 1 if messages else 0

    def stop(self, reason: str) -> None:
        if reason not in STOP_REASONS:
            raise ValueError(f"unknown episode stop reason {reason!r}; one of {STOP_REASONS}")
        self.stop_reason = reason

    @property
    def truncated(self) -> bool:
        return self.stop_reason in LENGTH_STOPS

    def final_answer(self) -> str:
        """The last assistant message (what the data source's grader reads)."""
        return next((m["content"] for m in reversed(self.messages) if m.get("role") == "assistant"), "")

    def sample(self, exclude_from_loss: bool = False) -> RolloutSample:
        """The episode as one sample: every id after the prompt, with its loss mask (all 0 when excluded)."""
        mask = [0] * len(self.loss_mask) if exclude_from_loss else list(self.loss_mask)
        info = EpisodeInfo(
            agent=self.agent, turns=self.assistant_turns, observations=self.user_turns,
            turn_rewards=list(self.turn_rewards), final_score=self.final_score, final_answer=self.final_answer(),
            stop_reason=self.stop_reason or "done", observation_tokens=self.loss_mask.count(0),
            tool_calls=dict(self.tool_calls), tool_failures=dict(self.tool_failures), env_errors=self.env_errors,
            env_timeouts=self.env_timeouts, env_seconds=self.env_seconds, template_check=self.template_check,
            non_finite_rewards=list(self.non_finite_rewards))
        return RolloutSample(token_ids=list(self.response_ids), logprobs=list(self.logprobs),
                             finish_reason=self.finish_reason, truncated=self.truncated, loss_mask=mask, episode=info,
                             policy_versions=None if self.versions is None else list(self.versions))
