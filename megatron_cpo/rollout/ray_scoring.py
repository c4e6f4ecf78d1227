"""A distillation teacher's scoring requests on Ray engines (`RolloutManager`'s scoring half).

Scoring requests (`VLLMEngine.score`: prompt log-probs of given responses) live apart from generation: `finished()`
and `cancel_all()` never see them. While `collect_scores` waits it looks after the engines' health as generation
does (`RolloutManager._look_after_engines`: pings, restarts), so a teacher engine that hangs or dies is given up
within `engine_health.check_interval_s + timeout_s` and its requests are scored again on the others, or, when it
was the last, on its restarted replacement once that is up (a teacher's engines load their own weights).
"""
from __future__ import annotations

from megatron_cpo.rollout.dispatch import TICK_S
from megatron_cpo.rollout.engine_actors import EngineActors
from megatron_cpo.rollout.score_book import ScoreBook
from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEnginesLostError


class RayScoreBook(ScoreBook):
    """Submit scoring requests to Ray engine actors (`collect_scores`: score_book.py); the subclass
    (`RolloutManager`) brings the engines and their health."""

    engines: list
    config: EngineLaunchConfig
    actors: EngineActors
    _scoring: dict  # Ray ObjectRef -> (ScoreRequest, engine index)

    def submit_score(self, request: ScoreRequest) -> None:
        """Score a group's responses on the engine with the fewest scoring requests; `collect_scores` returns it."""
        index = self._least_loaded(index for _, index in self._scoring.values())
        if index is None and self._restart_coming():
            self._score_orphans.append(request)  # scored once a restarted engine is up
            return
        if index is None:
            raise RolloutEnginesLostError(f"all {len(self.engines)} teacher engines are lost (last failure: "
                                          f"{self.last_engine_failure}); request {request.request_id!r} cannot be "
                                          "scored")
        self._scoring[self.engines[index].score.remote(request)] = (request, index)

    def _look_after_health(self) -> None:
        self._look_after_engines()

    def _wait_scores(self, refs: list) -> list:
        import ray

        return ray.wait(refs, num_returns=len(refs), timeout=TICK_S)[0]

    def _restart_coming(self) -> bool:
        return self.config.frozen_weights and bool(self.actors.replacements)

    def _take_score(self, ref) -> ScoredGroup | None:
        """A finished scoring request's scores; None when its engine failed (then it is scored again)."""
        import ray

        request, index = self._scoring.pop(ref)
        try:
            return ray.get(ref)
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
