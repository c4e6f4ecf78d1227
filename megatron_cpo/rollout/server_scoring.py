"""A distillation teacher's scoring requests on rollout servers (`ServerRolloutManager`'s scoring half; the Ray
engines' is ray_scoring.py).

While `collect_scores` waits it looks after the servers' health as generation does (`_look_after_servers`: pings,
stalls), so a teacher server that hangs or dies is given up within `engine_health.check_interval_s + timeout_s` and
its requests are scored again on the others; a teacher's servers hold their own weights (`frozen_weights`), so one
that answers `/health` again serves at once.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import uuid
from collections.abc import Iterable

from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.http_client import RolloutServerAuthError, RolloutServerError
from megatron_cpo.rollout.scoring import ScoredGroup, ScoredResponse, ScoreRequest
from megatron_cpo.rollout.types import RolloutEnginesLostError

TICK_S = 0.5  # the longest single wait between two looks at the servers' health


class ServerScoreBook:
    """Submit and collect scoring requests; the subclass (`ServerRolloutManager`) brings the servers and health."""

    engines: list
    _scoring: dict  # key -> (ScoreRequest, server index, Future)
    _score_orphans: list[ScoreRequest]  # requests of given-up servers, scored again at the next look

    def submit_score(self, request: ScoreRequest) -> None:
        """Score a group's responses on the live server with the fewest scoring requests."""
        index = self._least_loaded(index for _, index, _ in self._scoring.values())
        if index is None:
            raise RolloutEnginesLostError(self._lost_message(f"request {request.request_id!r} cannot be scored"))
        future = self._caller.spawn(self.engines[index], proto.SCORE, dataclasses.asdict(request), None,
                                    connect_timeout_s=self.config.timeout_s)
        self._scoring[uuid.uuid4().hex] = (request, index, future)

    def collect_scores(self, request_ids: Iterable[str] | None = None, timeout: float | None = None
                       ) -> dict[str, ScoredGroup]:
        """`RolloutManager.collect_scores` over HTTP: a given-up server's requests are scored again on the others;
        TimeoutError after `timeout` s in which none finished."""
        wanted = (set(request_ids) if request_ids is not None else
                  {r.request_id for r, _, _ in self._scoring.values()} | {r.request_id for r in self._score_orphans})
        done: dict[str, ScoredGroup] = {}
        progressed = time.monotonic()
        while wanted - done.keys():
            self._look_after_servers()
            self._resubmit_score_orphans()
            keys = [key for key, (request, _, _) in self._scoring.items() if request.request_id in wanted]
            if not keys:
                raise KeyError(f"scoring requests {sorted(wanted - done.keys())[:5]} were never submitted")
            concurrent.futures.wait([self._scoring[key][2] for key in keys], timeout=TICK_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
            for key in [key for key in keys if key in self._scoring and self._scoring[key][2].done()]:
                taken = self._take_score(key)
                if taken is not None:
                    done[taken.request_id] = taken
                    progressed = time.monotonic()
            if timeout is not None and time.monotonic() - progressed > timeout:
                raise TimeoutError(f"no scoring request finished within {timeout}s; {len(keys)} outstanding")
        return done

    def _take_score(self, key: str) -> ScoredGroup | None:
        """A finished scoring request's scores; None when its server failed (then it is scored again)."""
        request, index, future = self._scoring.pop(key)
        try:
            body = future.result()
        except RolloutServerError as err:
            if isinstance(err, RolloutServerAuthError) or (self._alive[index] and self._health_problem(index) is None):
                raise
            self._score_orphans.append(request)
            self._mark_dead(index, str(err))
            return None
        return ScoredGroup(body["request_id"], [ScoredResponse(**r) for r in body["responses"]])

    def _orphan_scoring_of(self, index: int) -> None:
        """Server `index` was given up: its scoring requests are scored again on the others."""
        for key in [key for key, (_, server, _) in self._scoring.items() if server == index]:
            request, _, future = self._scoring.pop(key)
            future.cancel()
            self._score_orphans.append(request)

    def _resubmit_score_orphans(self) -> None:
        orphans, self._score_orphans = self._score_orphans, []
        for position, request in enumerate(orphans):
            try:
                self.submit_score(request)
            except RolloutEnginesLostError:
                self._score_orphans = orphans[position:]
                raise
