"""Group generators: what the controller and validation submit prompts to, one data record -> one `RolloutGroup`.

`SingleTurnGenerator` samples answers from the engines; a multi-turn generator runs each sample as an episode
(megatron_cpo/envs/); either way batches fill the same. `GreedyBaselineGenerator` wraps either for ReMax, adding
each prompt's greedy answer from the same engines.
"""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from typing import Any, Protocol

from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams

GREEDY_SUFFIX = "/greedy"


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


class GreedyBaselineGenerator:
    """ReMax's baseline (Li et al., 2024): every submitted prompt also gets one greedy answer (temperature 0, the same
    length and stop tokens) from the same engines, returned with the prompt's samples as
    `RolloutGroup.greedy_baseline` once both have finished. The caller scores it with the same reward and does not
    train on it. Groups of requests it did not submit pass through unchanged."""

    def __init__(self, inner: GroupGenerator) -> None:
        self.inner = inner
        self._waiting: set[str] = set()  # submitted prompts not yet returned
        self._samples: dict[str, RolloutGroup] = {}
        self._greedy: dict[str, RolloutSample] = {}

    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        self.inner.submit(request_id, record, params)
        greedy = replace(params, n=1, temperature=0.0, top_p=1.0, top_k=-1, seed=None)
        self.inner.submit(request_id + GREEDY_SUFFIX, record, greedy)
        self._waiting.add(request_id)

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Groups whose samples and greedy answer have both finished (waiting on the engines until one has)."""
        ready: list[RolloutGroup] = []
        while not ready and self._waiting:
            groups = self.inner.finished(timeout=timeout)
            if not groups:
                break
            for group in groups:
                request_id = group.request_id.removesuffix(GREEDY_SUFFIX)
                if request_id not in self._waiting:
                    ready.append(group)
                elif request_id != group.request_id:
                    self._greedy[request_id] = group.samples[0]
                else:
                    self._samples[request_id] = group
            ready += [self._pair(request_id) for request_id in list(self._samples) if request_id in self._greedy]
        return ready

    def _pair(self, request_id: str) -> RolloutGroup:
        self._waiting.discard(request_id)
        return replace(self._samples.pop(request_id), greedy_baseline=self._greedy.pop(request_id))

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        while self._waiting:
            groups = self.finished(timeout=timeout)
            if not groups:
                return
            yield from groups

    def cancel_all(self) -> int:
        """Drop every outstanding prompt (its samples and its greedy answer); returns how many prompts."""
        self.inner.cancel_all()
        dropped = len(self._waiting)
        self._waiting.clear()
        self._samples.clear()
        self._greedy.clear()
        return dropped
