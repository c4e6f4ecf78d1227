"""A distillation teacher's scoring requests on Ray engines (`RolloutManager`'s scoring half).

Scoring requests (`VLLMEngine.score`: prompt log-probs of given responses) live apart from generation: `finished()`
and `cancel_all()` never see them. While `collect_scores` waits it looks after the engines' health as generation
does (`RolloutManager._look_after_engines`: pings, restarts), so a teacher engine that hangs or dies is given up
within `engine_health.check_interval_s + timeout_s` and its requests are scored again on the others, or, when it
was the last, on its restarted replacement once that is up (a teacher's engines load their own weights).
"""
from __future__ import annotations

import time
from collections.abc import Iterable

from megatron_cpo.rollout.engine_actors import EngineActors
from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEnginesLostError

TICK_S = 0.5  # the longest single wait on the engines between two looks at their health


class RayScoreBook:
    """Submit and collect scoring requests; the subclass (`RolloutManager`) brings the engines and their health."""

    engines: list
    config: EngineLaunchConfig
    actors: EngineActors
    _scoring: dict  # Ray ObjectRef -> (ScoreRequest, engine index)
    _score_orphans: list[ScoreRequest]  # requests of given-up engines, scored again at the next look

    def submit_score(self, request: ScoreRequest) -> None:
        """Score a group's responses on the engine with the fewest scoring requests; `collect_scores` returns it."""
        index = self._least_loaded(index for _, index in self._scoring.values())
        if index is None and self.config.frozen_weights and self.actors.replacements:
            self._score_orphans.append(request)  # scored once a restarted engine is up
            return
        if index is None:
            raise RolloutEnginesLostError(f"all {len(self.engines)} teacher engines are lost (last failure: "
                                          f"{self.last_engine_failure}); request {request.request_id!r} cannot be "
                                          "scored")
        self._scoring[self.engines[index].score.remote(request)] = (request, index)

    def collect_scores(self, request_ids: Iterable[str] | None = None, timeout: float | None = None
                       ) -> dict[str, ScoredGroup]:
        """Wait for the submitted scoring requests `request_ids` (None: all) and return them by id; the requests of
        an engine given up meanwhile are scored again on the others. TimeoutError after `timeout` s in which none
        finished."""
        import ray

        wanted = (set(request_ids) if request_ids is not None else
                  {r.request_id for r, _ in self._scoring.values()} | {r.request_id for r in self._score_orphans})
        done: dict[str, ScoredGroup] = {}
        progressed = time.monotonic()
        while wanted - done.keys():
            self._look_after_engines()
            self._resubmit_score_orphans()
            refs = [ref for ref, (request, _) in self._scoring.items() if request.request_id in wanted]
            waiting = any(request.request_id in wanted for request in self._score_orphans)  # for a restart
            if not refs and not waiting:
                raise KeyError(f"scoring requests {sorted(wanted - done.keys())[:5]} were never submitted")
            ready: list = []
            if refs:
                ready, _ = ray.wait(refs, num_returns=len(refs), timeout=TICK_S)
            else:
                time.sleep(TICK_S)
            for ref in ready:
                taken = self._take_score(ref)
                if taken is not None:
                    done[taken[0]] = taken[1]
                    progressed = time.monotonic()
            if self._score_orphans and self.actors.replacements:  # waiting for a restart (its own start timeout)
                progressed = time.monotonic()
            if timeout is not None and time.monotonic() - progressed > timeout:
                raise TimeoutError(f"no scoring request finished within {timeout}s; {len(refs)} outstanding")
        return done

    def _take_score(self, ref) -> tuple[str, ScoredGroup] | None:
        """A finished scoring request's id and scores; None when its engine failed (then it is scored again)."""
        import ray

        entry = self._scoring.pop(ref, None)
        if entry is None:  # its engine was given up meanwhile: the request is an orphan now
            return None
        request, index = entry
        try:
            return request.request_id, ray.get(ref)
        except ray.exceptions.RayError as err:
            if self._alive[index] and self._health_problem(index) is None:
                raise
            self._score_orphans.append(request)
            self._mark_dead(index, err)
            return None

    def _orphan_scoring_of(self, index: int) -> None:
        """Engine `index` was given up: its scoring requests are scored again on the others."""
        for ref in [ref for ref, (_, engine) in self._scoring.items() if engine == index]:
            self._score_orphans.append(self._scoring.pop(ref)[0])
            self.actors.abandon(ref)

    def _resubmit_score_orphans(self) -> None:
        if self.config.frozen_weights and not self._live_indices() and self.actors.replacements:
            return  # a restarted teacher engine takes them once it is up (within `collect_scores`' timeout)
        orphans, self._score_orphans = self._score_orphans, []
        for position, request in enumerate(orphans):
            try:
                self.submit_score(request)
            except RolloutEnginesLostError:
                self._score_orphans = orphans[position:]
                raise
