"""What both transports' scoring halves share (ray_scoring.py for Ray engines, server_scoring.py for rollout servers):
waiting for a distillation teacher's scoring requests while looking after the engines' health, and sending the
requests of given-up engines again.

A subclass keeps `_scoring` (its handle -> (ScoreRequest, engine index, ...) entries) and `_score_orphans`, and
provides `submit_score`, `_look_after_health` (one look at the engines, as generation's wait does), `_wait_scores`
(the handles of those that finished within `TICK_S`), `_take_score` (a finished handle's scores, or None when its
engine failed and the request became an orphan) and `_restart_coming` (a restarted engine that needs no push is on
its way, so orphans wait for it).
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from megatron_cpo.rollout.dispatch import TICK_S, send_queued
from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest


class ScoreBook:
    """`collect_scores` and the orphans' resubmission on top of a subclass's transport."""

    _scoring: dict
    _score_orphans: list[ScoreRequest]  # requests of given-up engines, scored again at the next look

    def collect_scores(self, request_ids: Iterable[str] | None = None, timeout: float | None = None
                       ) -> dict[str, ScoredGroup]:
        """Wait for the submitted scoring requests `request_ids` (None: all) and return them by id; the requests of
        an engine given up meanwhile are scored again on the others. TimeoutError after `timeout` s in which none
        finished (a restart being waited for does not count)."""
        wanted = (set(request_ids) if request_ids is not None else
                  {entry[0].request_id for entry in self._scoring.values()}
                  | {request.request_id for request in self._score_orphans})
        done: dict[str, ScoredGroup] = {}
        progressed = time.monotonic()
        while wanted - done.keys():
            self._look_after_health()
            self._resubmit_score_orphans()
            handles = [handle for handle, entry in self._scoring.items() if entry[0].request_id in wanted]
            waiting = any(request.request_id in wanted for request in self._score_orphans)  # for a restart
            if not handles and not waiting:
                raise KeyError(f"scoring requests {sorted(wanted - done.keys())[:5]} were never submitted")
            ready: list = []
            if handles:
                ready = self._wait_scores(handles)
            else:
                time.sleep(TICK_S)
            for handle in ready:
                entry = self._scoring.get(handle)
                if entry is None:  # its engine was given up meanwhile: the request is an orphan now
                    continue
                group = self._take_score(handle)
                if group is not None:
                    done[entry[0].request_id] = group
                    progressed = time.monotonic()
            if self._score_orphans and self._restart_coming():  # the restart has its own start timeout
                progressed = time.monotonic()
            if timeout is not None and time.monotonic() - progressed > timeout:
                raise TimeoutError(f"no scoring request finished within {timeout}s; {len(handles)} outstanding")
        return done

    def _resubmit_score_orphans(self) -> None:
        if not self._live_indices() and self._restart_coming():
            return  # the restarted engine takes them once it is up (within `collect_scores`' timeout)
        send_queued(self._score_orphans, self.submit_score)
