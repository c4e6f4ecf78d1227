"""The request bookkeeping every rollout manager shares (Ray engines, rollout servers): which prompts are
outstanding on which engine, which engines are alive, and the generator over finished groups.

A subclass keeps `engines`, `_alive` and `_pending` (its own handle -> request entries), and provides `_requests()`
(the outstanding `EngineRequest`s), `_dispatch` (send one to the least-loaded live engine), `_wait_one` and `_take`
(the next finished handle, and its group or None when it was re-dispatched) and `shutdown`; `_outstanding()` says
whether anything is outstanding (the pending entries, and requests of given-up engines waiting to be sent again).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

from megatron_cpo.rollout.types import RolloutGroup, SamplingParams

TICK_S = 0.5  # the longest single wait on the engines (or servers) between two looks at their health
Request = TypeVar("Request")


def send_queued(queue: list[Request], send: Callable[[Request], None]) -> None:
    """Send the requests of `queue` (a given-up engine's, sent again) in order, each taken off once sent; when `send`
    raises (the last engine is lost) the unsent stay queued, for a restart or the error's count."""
    while queue:
        send(queue[0])
        del queue[0]


@dataclass
class EngineRequest:
    """One prompt in flight: `params.n` samples on engine `engine_index` (-1 before dispatch)."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    engine_index: int


class RequestBook:
    """Submit, liveness and the finished-group generator on top of a subclass's transport."""

    engines: list
    _alive: list[bool]
    _pending: dict

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue one prompt for `params.n` samples on the least-loaded live engine."""
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt; submit at least one token id")
        self._dispatch(EngineRequest(request_id, list(prompt_token_ids), params, -1))

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        """Yield groups as they finish until nothing is outstanding. `timeout` bounds the wait for each next
        group (TimeoutError names how many are outstanding); re-dispatches the prompts of engines that died."""
        while self._outstanding():
            group = self._take(self._wait_one(timeout))
            if group is not None:
                yield group

    def num_engines_alive(self) -> int:
        """Engines not known to be dead (a death is noticed by a failed request, weight sync or `check_engines`)."""
        return sum(self._alive)

    def _outstanding(self) -> bool:
        return bool(self._pending)

    def _least_loaded(self, busy: Iterable[int]) -> int | None:
        """The live engine with the fewest of `busy` (one engine index per request in flight), lowest index first;
        None when no engine is live."""
        load = {i: 0 for i in self._live_indices()}
        for index in busy:
            if index in load:
                load[index] += 1
        return min(load, key=lambda i: (load[i], i)) if load else None

    def _live_indices(self) -> list[int]:
        return [i for i, alive in enumerate(self._alive) if alive]

    def __enter__(self) -> RequestBook:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
