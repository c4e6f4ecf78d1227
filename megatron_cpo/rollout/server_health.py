"""`ServerRolloutManager`'s look after its servers' health (server_client.py has the requests and the pushes).

Live servers are pinged at `/health` every `engine_health.check_interval_s` without waiting for the answer; one whose
ping fails or is not answered within `engine_health.timeout_s`, or that stalls while others finish groups (health.py),
is given up once (logged, its requests queued to be sent to the others). Given-up servers keep being pinged: one that
answers healthy again is taken back, at the next weight push (it takes the push before requests) or at once for a
teacher's servers, which hold their own weights (`frozen_weights`).
"""
from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.dispatch import send_queued
from megatron_cpo.rollout.health import EngineWatch
from megatron_cpo.rollout.http_client import HttpCaller, RolloutServerError, health_problem

logger = logging.getLogger(__name__)


class ServerHealthBook:
    """Pings, stalls, giving servers up and taking them back; the subclass (`ServerRolloutManager`) brings the
    servers, their requests and the transport."""

    engines: list
    config: Any  # ServerClientConfig (server_client.py, which imports this module): timeouts, health, frozen_weights
    engine_restarts: int
    _caller: HttpCaller
    _watch: EngineWatch
    _alive: list[bool]
    _pending: dict  # key -> (EngineRequest, Future)
    _orphans: list  # requests of given-up servers, sent again at the next look
    _failures: dict[int, str]
    _pings: dict  # server -> its /health call in flight
    _recovered: set[int]
    _joining: set[int]

    @property
    def last_engine_failure(self) -> str | None:
        """Why the servers not serving now were given up, the latest last."""
        return "; ".join(self._failures.values()) or None

    def num_engines_restarting(self) -> int:
        """Given-up servers that answered healthy again and have not yet taken a push (the trainer restarts none)."""
        return len(self._joining | (self._recovered - set(self._live_indices())))

    def health(self) -> list[bool]:
        return [self._alive[i] and self._health_problem(i) is None for i in range(len(self.engines))]

    def check_engines(self) -> int:
        """Health-check the live servers at once, give up those that fail (logged once), ping the given-up ones
        (without waiting); returns how many servers the next push reaches (live, and given-up ones that answered
        healthy since)."""
        self._check_at_once(self._live_indices())
        self._poll_pings()
        return self.num_engines_alive() + self.num_engines_restarting()

    def _health_problem(self, index: int) -> str | None:
        return health_problem(self._caller, self.engines[index], self.config.timeout_s)[0]

    def _mark_dead(self, index: int, cause: str) -> None:
        """Give up server `index` (once): log it, drop its requests (sent again at the next look)."""
        if not (self._alive[index] or index in self._joining):
            return
        self._alive[index] = False
        self._joining.discard(index)
        self._watch.forget(index)
        for key, (request, future) in list(self._pending.items()):
            if request.engine_index == index:
                del self._pending[key]
                future.cancel()
                self._orphans.append(request)
        self._orphan_scoring_of(index)
        self._failures.pop(index, None)
        self._failures[index] = f"server {index} ({self.engines[index]}): {cause}"
        logger.warning("rollout server %d (%s) failed: %s; %d of %d servers left (rollout/engines_alive), its %d "
                       "requests go to them; it is taken back once it answers /health again", index,
                       self.engines[index], cause, self.num_engines_alive(), len(self.engines),
                       sum(r.engine_index == index for r in self._orphans))

    def _look_after_servers(self) -> None:
        """One look while waiting: the pings (`_poll_pings`), servers that stalled, and given-up servers' requests
        sent again."""
        self._watch.look(time.monotonic())
        self._poll_pings()
        if self.config.frozen_weights:  # a teacher's server takes no push: healthy again, it serves
            self._take_back_recovered()
        busy = sorted({request.engine_index for request, _ in self._pending.values()})
        for index in self._watch.stalled(busy, self._live_indices()):
            self._mark_dead(index, f"finished no request for actor_rollout_ref.rollout.engine_health.stall_timeout_s="
                                   f"{self.config.health.stall_timeout_s:g}s while other servers finished groups")
        send_queued(self._orphans, self._dispatch)

    def _poll_pings(self) -> None:
        """Ping the servers that are due (given-up ones too, to take them back) without waiting, note the given-up
        ones that answered healthy, give up live ones whose ping failed or is overdue."""
        now = time.monotonic()
        for index in self._watch.pings_due(now, [i for i in range(len(self.engines)) if i not in self._joining]):
            self._pings[index] = self._caller.spawn(self.engines[index], proto.HEALTH, None,
                                                    self.config.health.timeout_s)
            self._watch.ping_sent(index, now)
        for index, ping in list(self._pings.items()):
            if not ping.done():
                continue
            del self._pings[index]
            self._watch.ping_answered(index)
            error = ping.exception()
            problem = (str(error) if error is not None else None if ping.result().get("ok")
                       else f"unhealthy: {'; '.join(ping.result().get('problems', []))}")
            if not self._alive[index]:
                if problem is None:
                    self._recovered.add(index)
            elif problem is not None:
                self._mark_dead(index, f"failed its health check: {problem}")
        for index in self._watch.unanswered(now):
            ping = self._pings.pop(index, None)
            if ping is not None:
                ping.cancel()
            self._watch.ping_answered(index)
            if self._alive[index]:
                self._mark_dead(index, f"did not answer /health within actor_rollout_ref.rollout.engine_health."
                                       f"timeout_s={self.config.health.timeout_s:g}s (hung: a stopped or deadlocked "
                                       "server or engine process, or a device that stopped answering)")

    def _take_back_recovered(self) -> None:
        """Given-up servers that answered healthy since join this push; what they still ran is cancelled first."""
        for index in sorted(self._recovered):
            self._recovered.discard(index)
            if self._alive[index]:
                continue
            try:
                self._caller.call(self.engines[index], proto.CANCEL, {}, self.config.timeout_s)
            except RolloutServerError as err:
                logger.warning("rollout server %d (%s) answered /health but not /cancel (%s); not taken back yet",
                               index, self.engines[index], err)
                continue
            if self.config.frozen_weights:
                self._alive[index] = True
                self._failures.pop(index, None)
                self._watch.forget(index)
                self.engine_restarts += 1
                logger.warning("server %d (%s) answers /health again and serves", index, self.engines[index])
                continue
            self._joining.add(index)
            logger.warning("rollout server %d (%s) answers /health again: it takes this weight push, then requests",
                           index, self.engines[index])

    def _check_at_once(self, indices: list[int]) -> None:
        """/health of servers `indices` at once (at most `engine_health.timeout_s`); give up those that fail."""
        calls = {i: self._caller.spawn(self.engines[i], proto.HEALTH, None, self.config.health.timeout_s)
                 for i in indices}
        concurrent.futures.wait(calls.values())
        for index, call in calls.items():
            error = call.exception()
            if error is not None:
                self._mark_dead(index, f"failed its health check: {error}")
            elif not call.result().get("ok"):
                self._mark_dead(index, f"unhealthy: {'; '.join(call.result().get('problems', []))}")

    def _restart_clocks(self) -> None:
        """A weight push: pings in flight may be answered late, stall clocks start over."""
        for ping in self._pings.values():
            ping.cancel()
        self._pings.clear()
        self._watch.restart_clocks()
