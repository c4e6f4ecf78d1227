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
import uuid

from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.dispatch import TICK_S
from megatron_cpo.rollout.http_client import RolloutServerAuthError, RolloutServerError
from megatron_cpo.rollout.score_book import ScoreBook
from megatron_cpo.rollout.scoring import ScoredGroup, ScoredResponse, ScoreRequest
from megatron_cpo.rollout.types import RolloutEnginesLostError


class ServerScoreBook(ScoreBook):
    """Submit scoring requests to rollout servers (`collect_scores`: score_book.py); the subclass
    (`ServerRolloutManager`) brings the servers and their health."""

    engines: list
    _scoring: dict  # key -> (ScoreRequest, server index, Future)

    def submit_score(self, request: ScoreRequest) -> None:
        """Score a group's responses on the live server with the fewest scoring requests."""
        index = self._least_loaded(index for _, index, _ in self._scoring.values())
        if index is None:
            raise RolloutEnginesLostError(self._lost_message(f"request {request.request_id!r} cannot be scored"))
        future = self._caller.spawn(self.engines[index], proto.SCORE, dataclasses.asdict(request), None,
                                    connect_timeout_s=self.config.timeout_s)
        self._scoring[uuid.uuid4().hex] = (request, index, future)

    def _look_after_health(self) -> None:
        self._look_after_servers()

    def _wait_scores(self, keys: list[str]) -> list[str]:
        concurrent.futures.wait([self._scoring[key][2] for key in keys], timeout=TICK_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        return [key for key in keys if self._scoring[key][2].done()]

    def _restart_coming(self) -> bool:
        return False  # the trainer restarts no server

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
