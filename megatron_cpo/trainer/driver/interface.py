"""The driver interface: the same methods on every rank, so the step loop never asks which rank it is.

Rank 0's `LeadDriver` (`lead.py`) does the work (data, engines, controller, grading, validation, logging) and
broadcasts what the other ranks must know; every other rank's `FollowerDriver` (`follower.py`) receives it. A method
marked collective is called by every rank together, in the same order; the others stay on their rank.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.driver.controller import CollectedBatch
from megatron_cpo.trainer.driver.teacher_feed import TeacherBatch


@dataclass(frozen=True)
class CollectOutcome:
    """Step 1 on one rank: rank 0's kept groups (`collected`; None on the other ranks, and when the run ends) with
    their distillation teachers' scores (`teacher`; None without engine teachers) and, on every rank, why the run
    ends before the update: no engine is left (`engines_lost`), or a reward or a teacher's log-prob was refused as not
    finite (`rewards_refused`, `reward.non_finite=error`; `teacher_refused`); each a one-line message.
    `engines_restarting`: with `engines_lost`, how many engines started in place of lost ones are coming
    (rollout/engine_actors.py); then the last weights are pushed again and the step is collected again."""
    collected: CollectedBatch | None
    engines_lost: str | None = None
    rewards_refused: str | None = None
    engines_restarting: int = 0
    teacher: TeacherBatch | None = None
    teacher_refused: str | None = None

    @property
    def refused(self) -> str | None:
        """Why the step's values cannot be trained on (a reward or a teacher's log-prob), else None."""
        return self.rewards_refused or self.teacher_refused


@dataclass(frozen=True)
class StepControls:
    """What the run controls make of a step, on every rank: the early-stop monitor stopped the run, a validation
    is due by `trainer.test_freq_samples`, the sample budget is spent; `metrics`: rank 0's for the step's row."""
    early_stopped: bool
    validation_due: bool
    budget_spent: bool
    metrics: dict[str, float] = field(default_factory=dict)


class Driver(ABC):
    """One rank's side of the run outside Megatron (docs/architecture.md, "One RL step"). `engines`: rank 0's
    engines, for the collectives that address them (the weight push, the sync probe); None elsewhere."""

    engines: RolloutEngines | None

    @abstractmethod
    def train_prompts(self) -> int:
        """Collective: the number of training prompts (it sizes the run)."""

    @abstractmethod
    def checkpointed(self) -> tuple[Any, dict[str, Any]]:
        """What a checkpoint keeps of the driver: the data position (rank 0's controller) and the run controls by
        name (early stop, sample budget); (None, {}) elsewhere."""

    @abstractmethod
    def open(self, total_steps: int, start_step: int) -> str | None:
        """Collective, before training: start the metric sinks; why this run has nothing left to train (rank 0 logs
        it), else None."""

    @abstractmethod
    def announce(self, message: str, *args: Any) -> None:
        """Log one line about the whole run (INFO), once: on rank 0."""

    @abstractmethod
    def collect(self, step: int) -> CollectOutcome:
        """Collective, step 1: collect the step's groups; every rank learns whether the run ends here."""

    @abstractmethod
    def make_batch(self, outcome: CollectOutcome) -> StepBatch | None:
        """Collective, step 2: the collected groups as the `StepBatch` every rank trains on; None when there is
        nothing to train on (the run ends)."""

    @abstractmethod
    def watch_mismatch(self, step: int, metrics: dict[str, float]) -> None:
        """Rank 0 watches the step's engine-vs-trainer mismatch for a push gone wrong (`mismatch_watch.py`)."""

    @abstractmethod
    def generation_held(self) -> AbstractContextManager[None]:
        """What the weight push runs inside: no episode submits a turn meanwhile."""

    @abstractmethod
    def check_engines(self) -> str | None:
        """Collective, before a push: why no engine answers any more (the last failure), else None."""

    @abstractmethod
    def engine_counts(self) -> tuple[int, int]:
        """(alive, started) of rank 0's engines; (0, 0) elsewhere."""

    @abstractmethod
    def engine_failure(self) -> str | None:
        """The last engine failure rank 0 saw; None elsewhere."""

    @abstractmethod
    def observe_controls(self, outcome: CollectOutcome) -> StepControls:
        """Collective, step 8: feed the early-stop monitor and the sample count with the step's rollout."""

    @abstractmethod
    def validate(self) -> dict[str, float]:
        """Step 9: validation metrics on rank 0; {} elsewhere."""

    @abstractmethod
    def log_step(self, step: int, metrics: dict[str, float], outcome: CollectOutcome, seconds: float
                 ) -> dict[str, float]:
        """Step 10: rank 0 adds its rollout, reward and timing metrics and writes the step's row (returned); {}
        elsewhere."""

    @abstractmethod
    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """Rank 0 writes a row outside a step (validation before training, or after the data ran out)."""

    @abstractmethod
    def log_end(self, step: int, early_stopped: bool) -> None:
        """Rank 0 logs why the run ends after `step`: the early stop, or else the spent sample budget."""

    @abstractmethod
    def close(self) -> None:
        """Release what the driver holds (sinks, graders, engines it started)."""
