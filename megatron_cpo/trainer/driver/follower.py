"""The driver of every rank but 0: it receives what rank 0's `LeadDriver` decides and broadcasts, and holds nothing
of its own (no data, engines, graders or sinks)."""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.collectives import broadcast_batch, broadcast_object
from megatron_cpo.trainer.driver.interface import CollectOutcome, Driver, StepControls


class FollowerDriver(Driver):
    """Each collective method receives rank 0's value (`trainer/collectives.py`); the others are rank 0's alone and
    do nothing here."""

    engines = None

    def train_prompts(self) -> int:
        return broadcast_object(None)

    def checkpointed(self) -> tuple[None, dict[str, Any]]:
        return None, {}

    def open(self, total_steps: int, start_step: int) -> str | None:
        return broadcast_object(None)

    def announce(self, message: str, *args: Any) -> None:
        pass

    def collect(self, step: int) -> CollectOutcome:
        engines_lost, rewards_refused, engines_restarting, teacher_refused = broadcast_object(None)
        return CollectOutcome(None, engines_lost, rewards_refused, engines_restarting=engines_restarting,
                              teacher_refused=teacher_refused)

    def make_batch(self, outcome: CollectOutcome) -> StepBatch | None:
        return broadcast_batch(None)

    def watch_mismatch(self, step: int, metrics: dict[str, float]) -> None:
        pass

    def generation_held(self) -> AbstractContextManager[None]:
        return nullcontext()

    def check_engines(self) -> str | None:
        return broadcast_object(None)

    def engine_counts(self) -> tuple[int, int]:
        return 0, 0

    def engine_failure(self) -> str | None:
        return None

    def observe_controls(self, outcome: CollectOutcome) -> StepControls:
        return StepControls(*broadcast_object(None))

    def validate(self) -> dict[str, float]:
        return {}

    def log_step(self, step: int, metrics: dict[str, float], outcome: CollectOutcome, seconds: float
                 ) -> dict[str, float]:
        return {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        pass

    def log_end(self, step: int, early_stopped: bool) -> None:
        pass

    def close(self) -> None:
        pass
