"""Group generators: what the controller and validation submit prompts to.

A generator turns one data record into one `RolloutGroup` of `params.n` samples. `SingleTurnGenerator` samples one
answer per sample from the engines; a multi-turn generator runs each sample as an episode against an environment
between turns (megatron_cpo/envs/). The controller and validation only see `GroupGenerator`, so the kind of episode
never changes how batches are filled, filtered or committed.
"""
from __future__ import annotations

from typing import Any, Iterator, Protocol

from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import RolloutGroup, SamplingParams


class GroupGenerator(Protocol):
    """Generates the group of samples of a data record (any object with `prompt_ids`)."""

    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        """Start the `params.n` samples of `record`; its group is returned by `finished` / `completed`."""

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait for one group, then return it with every other group already finished; [] when none is outstanding."""

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        """Yield groups as they finish until nothing is outstanding."""

    def cancel_all(self) -> int:
        """Drop every outstanding group; returns how many were dropped."""


class SingleTurnGenerator:
    """One sampled answer per sample: the record's prompt ids go to the engines as they are."""

    def __init__(self, engines: RolloutEngines) -> None:
        self.engines = engines

    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        self.engines.submit(request_id, list(record.prompt_ids), params)

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        return self.engines.finished(timeout=timeout)

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        return self.engines.completed(timeout=timeout)

    def cancel_all(self) -> int:
        return self.engines.cancel_all()
