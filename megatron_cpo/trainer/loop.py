"""The step loop, the same on every rank: `Trainer.fit()` and `Trainer.step()` over the run's typed parts.

`Trainer.step()` is docs/architecture.md's "One RL step", one call per item: collect, the batch on every rank,
log-probs, advantages, update, push, reference sync, run controls, validation, log, checkpoint. Rank 0's work and
every broadcast of its decisions sit behind the driver (`driver/interface.py`), so the loop never asks which rank it
is. How a run ends (SIGTERM, lost engines, refused rewards or teacher scores, skipped updates): docs/trainer.md.
The composition root that builds a `Trainer` is `assemble.py`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_cpo.trainer.collectives import any_rank, barrier
from megatron_cpo.trainer.components import RunSettings
from megatron_cpo.trainer.driver.interface import CollectOutcome, Driver
from megatron_cpo.trainer.run.checkpointing import CheckpointError, CheckpointManager
from megatron_cpo.trainer.run.errors import RunAbortedError
from megatron_cpo.trainer.run.run_guards import (
    StopSignal,
    engines_lost_message,
    nothing_to_train_message,
    rewards_refused_message,
    weights_not_finite_message,
)
from megatron_cpo.trainer.workers.actor import MegatronPolicy
from megatron_cpo.trainer.workers.critic import MegatronCritic
from megatron_cpo.trainer.workers.distillation_step import TrainerTeacher
from megatron_cpo.trainer.workers.offload import ActorOffload, offloaded_during
from megatron_cpo.trainer.workers.policy_update import (
    compute_advantages,
    compute_log_probs,
    update_critic,
    update_policy,
)
from megatron_cpo.trainer.workers.sync_probe import (
    EngineOutOfSyncError,
    SyncProbe,
    TrainerNotFiniteError,
    sync_check_metrics,
)
from megatron_cpo.trainer.workers.update_guard import FiniteProbe
from megatron_cpo.trainer.workers.weight_push import push_weights

logger = logging.getLogger(__name__)


@dataclass
class PushOutcome:
    """How a weight push ended: its metrics (the sync check's included), or why the run cannot go on: `lost` (no
    engine left) or `out_of_sync` (the engines do not serve the pushed weights, or with `trainer_not_finite` the
    trainer's own weights are not finite, `sync_probe.py`)."""
    metrics: dict[str, float]
    lost: str | None = None
    out_of_sync: str | None = None
    trainer_not_finite: bool = False


@dataclass
class StepOutcome:
    """How a step ended: `stop` (SIGTERM on some rank: checkpointed, the run returns), `early_stopped` or
    `budget_spent`."""
    metrics: dict[str, float]
    stop: bool = False
    early_stopped: bool = False
    budget_spent: bool = False  # trainer.total_rollout_samples reached


@dataclass(eq=False)
class Trainer:
    """One run on every rank, from its parts (`assemble.build_trainer` builds them): the rank's `driver`, the
    Megatron `actor`, its frozen `reference` and PPO's `critic` (when the run has them), their colocated `offloads`,
    the `checkpoints`, the push's `sync_probe` and the run's `settings`; `started_engines`: what this rank started
    for `rollout.mode=colocate` (shut down by `close`). `fit()` trains; `close()` releases everything."""
    driver: Driver
    actor: MegatronPolicy
    reference: MegatronPolicy | None
    critic: MegatronCritic | None
    offloads: tuple[ActorOffload | None, ActorOffload | None]
    checkpoints: CheckpointManager
    sync_probe: SyncProbe
    settings: RunSettings
    pad_token_id: int
    started_engines: Any = None
    teacher: TrainerTeacher | None = None  # distillation's teacher in the trainer (kind megatron or self)

    # --- the run ---------------------------------------------------------------------------------------------
    def fit(self, stop: StopSignal) -> dict[str, float]:
        """Resume, validate, train until the last step (or data, early stop, SIGTERM); rank 0's last metrics."""
        settings, total = self.settings, self.settings.total_steps
        start_step = self.checkpoints.maybe_resume(settings.resume)
        if self.driver.open(total, start_step) is not None:  # nothing left to train (rank 0 said why)
            return {}
        pushed = self.push_weights_or_abort(start_step)
        last: dict[str, float] = {}
        if settings.val_before_train and start_step == 0:
            self.driver.announce("validating before training (greedy, held-out prompts); then %d steps", total)
            last = self.validate()
            self.driver.log_metrics({**last, **sync_check_metrics(pushed.metrics)}, 0)
        step = start_step
        while step < total:
            outcome = self.step(step + 1, stop)
            if outcome is None:
                if step == start_step == 0:
                    raise ValueError(nothing_to_train_message(settings.train_batch_size))
                logger.info("no batch at step %d (data exhausted); ending the run", step + 1)
                last.update(self._validate_after_exhaustion(step, start_step))
                break
            step += 1
            last = outcome.metrics
            if outcome.stop:
                logger.warning("stopped by SIGTERM after step %d; resume with trainer.resume=auto", step)
                return last
            if outcome.early_stopped or outcome.budget_spent:
                self.driver.log_end(step, outcome.early_stopped)
                break
        if step > 0 and self.checkpoints.saved_step != step:
            self.checkpoints.save(step)  # the last (or early-stopped) step, whatever save_freq is
        return last

    def step(self, step: int, stop: StopSignal) -> StepOutcome | None:
        """One RL step (docs/architecture.md, "One RL step"); None when no batch could be formed (data ran out)."""
        driver, started = self.driver, time.perf_counter()
        collected = self.collect(step)                                                              # 1
        batch = driver.make_batch(collected)                                                        # 2
        if batch is None:
            return None
        settings, probe = self.settings.update, FiniteProbe()  # probe: where the step's first non-finite value was
        log_probs = compute_log_probs(batch, self.actor, self.reference, settings, self.pad_token_id,   # 3
                                      self.critic, probe, self.teacher)
        advantages, metrics = compute_advantages(batch, log_probs, settings, probe)                 # 4
        if self.critic is not None:                                                                 # 5
            metrics.update(update_critic(self.critic, log_probs, advantages, settings, probe))
        metrics.update(update_policy(self.actor, batch, log_probs, advantages, settings, probe,
                                     train=step > settings.critic_warmup).metrics)
        driver.watch_mismatch(step, metrics)
        pushed = self.push_weights(step)                                                            # 6
        metrics.update(pushed.metrics)
        self.sync_reference(step)                                                                   # 7
        controls = driver.observe_controls(collected)                                               # 8
        metrics.update(controls.metrics)
        stopping = any_rank(stop.received)
        healthy = pushed.lost is None and pushed.out_of_sync is None
        last = step == self.settings.total_steps or controls.early_stopped or controls.budget_spent
        due = healthy and (controls.validation_due or self._validation_due(step, last))
        validation = self.validate() if due else {}  # 9; the last step's row carries the final validation
        metrics = driver.log_step(step, {**metrics, **validation}, collected, time.perf_counter() - started)  # 10
        self.abort_if_push_failed(step, pushed, last)
        self.abort_if_updates_skipped(step)
        # 11: metrics are logged before the checkpoint: a kill in between redoes the step (its rows are cut on resume),
        # while the other order would lose its metrics; the last step is saved by `fit`
        if stopping or self._save_due(step):
            self.checkpoints.save(step)
        return StepOutcome(metrics, stopping, controls.early_stopped, controls.budget_spent)

    # --- the step's parts ------------------------------------------------------------------------------------
    def collect(self, step: int) -> CollectOutcome:
        """The step's groups (rank 0's; colocated, every rank's actor is offloaded meanwhile). When no engine is left,
        or a reward (`reward.non_finite=error`) or a distillation teacher's log-prob is not finite, every rank
        checkpoints the steps trained so far (with the actor back in place) and the run is aborted."""
        with offloaded_during(*self.offloads):
            collected = self.driver.collect(step)
        if collected.refused is not None:
            raise RunAbortedError(rewards_refused_message(collected.refused, step,
                                                          self._checkpoint_before_abort(step - 1)))
        if collected.engines_lost is not None:
            if collected.engines_restarting:  # they take the weights of step - 1, then the step is collected again
                self.push_weights_or_abort(step - 1)
                return self.collect(step)
            self.abort_engines_lost(step - 1)
        return collected

    def push_weights(self, step: int) -> PushOutcome:
        """Push the actor's weights of step `step` to the live engines and check that they serve them
        (`sync_probe.py`). Rank 0 health-checks the engines first, so an engine that died since the last request
        is noticed here; its episodes in flight (which advance on their own thread) submit no turn meanwhile."""
        with self.driver.generation_held():
            return self._push_and_check(step)

    def _push_and_check(self, step: int) -> PushOutcome:
        from megatron_cpo.rollout import RolloutEnginesLostError

        lost = self.driver.check_engines()
        if lost is not None:
            return PushOutcome({}, lost=lost)
        engines, (alive, _) = self.driver.engines, self.driver.engine_counts()
        in_flight = self.settings.in_flight
        hold = self.sync_probe.holds_paused_requests(in_flight)  # the probe runs before they go on
        try:
            metrics, reports = push_weights(self.actor.model, engines, in_flight, resume=not hold)
        except Exception as err:
            import ray  # only now: a sending rank must not import Ray before push_weights set its authentication mode

            # with one rank: an engine lost in a collective transfer leaves the survivors with a partial update, so
            # the run stops here too; with more, the other ranks are inside the transfer (no clean way back)
            if not isinstance(err, (RolloutEnginesLostError, ray.exceptions.RayError)) or dist.get_world_size() > 1:
                raise
            engines.check_engines()
            if engines.num_engines_alive() == alive:
                raise  # not an engine death
            return PushOutcome({}, lost=self.driver.engine_failure())
        try:
            metrics.update(self.sync_probe.after_push(step, self.actor, engines, reports, held=hold))
        except EngineOutOfSyncError as err:
            return PushOutcome({**metrics, **err.metrics}, out_of_sync=str(err),
                               trainer_not_finite=isinstance(err, TrainerNotFiniteError))
        return PushOutcome(metrics)

    def push_weights_or_abort(self, step: int) -> PushOutcome:
        pushed = self.push_weights(step)
        self.abort_if_push_failed(step, pushed)
        return pushed

    def abort_if_push_failed(self, step: int, pushed: PushOutcome, last: bool = False) -> None:
        """`last`: `step` ends the run (its last step, an early stop or the spent sample budget)."""
        if pushed.lost is not None:
            self.abort_engines_lost(step, last)
        if pushed.trainer_not_finite:  # no checkpoint may hold these weights: the last one written is the last good one
            raise RunAbortedError(weights_not_finite_message(pushed.out_of_sync, self.checkpoints.saved_path))
        if pushed.out_of_sync is not None:
            saved = self._checkpoint_before_abort(step)
            kept = (f"the trained weights are checkpointed in {saved}; resume with trainer.resume=auto once the "
                    "engines take weights correctly" if saved else "nothing was trained yet")
            raise RunAbortedError(f"{pushed.out_of_sync}; {kept} (actor_rollout_ref.rollout.sync_check.enable=false "
                                  "trains on regardless)")

    def abort_if_updates_skipped(self, step: int) -> None:
        """Every rank ends the run, checkpointed, once the actor's (or the critic's) guard skipped too many steps in a
        row."""
        guard = next((model.guard for model in (self.actor, self.critic) if model and model.guard.exhausted), None)
        if guard is not None:
            try:
                kept = (f"checkpointed in {self._checkpoint_before_abort(step)} (resume with trainer.resume=auto once "
                        "the cause is fixed)")
            except CheckpointError as err:  # the weights themselves are not finite: nothing is written
                kept = str(err)
            raise RunAbortedError(f"{guard.abort_message(step)}; {kept}")

    def sync_reference(self, step: int) -> None:
        """verl's `ref.sync_ref_model`: mix the actor into the reference every `ref_model_sync_steps` steps."""
        every = self.settings.reference_sync_steps
        if self.reference is not None and every > 0 and step % every == 0:
            self.actor.mix_into(self.reference, self.settings.reference_sync_alpha)

    def abort_engines_lost(self, step: int, last: bool = False) -> None:
        """Checkpoint the `step` trained steps (unless already saved) and raise `RunAbortedError` on every rank;
        `last`: nothing is left to train after `step`, so its final validation is what is lost."""
        saved = self._checkpoint_before_abort(step)
        raise RunAbortedError(engines_lost_message(self.driver.engine_failure(), self.driver.engine_counts(), step,
                                                   saved, last_step=last))

    def _checkpoint_before_abort(self, step: int) -> Path | None:
        """The checkpoint of the `step` trained steps (written now unless it exists); None before any step."""
        if step <= 0:
            return None
        if self.checkpoints.saved_step != step:
            return self.checkpoints.save(step)
        return self.checkpoints.root / f"step_{step:06d}"

    def validate(self) -> dict[str, float]:
        """Rank 0 validates on the engines (metrics on rank 0, {} elsewhere); colocated, every rank's actor stays
        offloaded until rank 0 is done, since the engines generate on the trainer's devices."""
        with offloaded_during(*self.offloads):
            metrics = self.driver.validate()
            if any(self.offloads):
                barrier()
        return metrics

    def _validation_due(self, step: int, last: bool) -> bool:
        freq = self.settings.test_freq
        return last or (freq > 0 and step % freq == 0)

    def _save_due(self, step: int) -> bool:
        freq = self.settings.save_freq
        return freq > 0 and step % freq == 0 and step < self.settings.total_steps

    def _validate_after_exhaustion(self, step: int, start_step: int) -> dict[str, float]:
        """Rank 0's final validation when the data ran out (otherwise the last step's row has it)."""
        if step <= start_step:
            return {}
        final = self.validate()
        if final:
            self.driver.log_metrics(final, step)
        return final

    def close(self) -> None:
        try:
            self.driver.close()
        finally:
            if self.started_engines is not None:
                self.started_engines.shutdown()
