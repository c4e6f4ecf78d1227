"""The training run: SPMD under torchrun; rank 0 also drives the rollout engines (`rank_zero.py`).

`Trainer.step()` is the numbered list of docs/architecture.md ("One RL step"), one call per item: 1 collect (rank 0) ->
2 broadcast the batch -> 3 log-probs -> 4 advantages -> 5 update -> 6 push weights -> 7 sync the reference -> 8
early-stop check -> 9 validate when due -> 10 log (rank 0) -> 11 checkpoint when due. Every collective is in
`collectives.py`; rank-0 work is in `RankZero`'s methods. `Trainer.fit()` resumes, validates before the first step and
after the last, and always checkpoints the last step; with `trainer.early_stop.enable` the run also ends (checkpointed,
reason logged) once the reward variance has collapsed, and with `trainer.total_rollout_samples` once it has generated
that many samples (validation is also due after every `trainer.test_freq_samples` of them). SIGTERM (SLURM preemption)
finishes the current step, checkpoints and stops; a run that loses every rollout engine checkpoints what it trained and
raises `RunAbortedError` (one line naming the engine and the fix), as does a non-finite reward
(`reward.non_finite=error`) or too many optimizer steps skipped in a row for non-finite values
(trainer/workers/update_guard.py).

This module, with `megatron_cpo/config.py` and `command.py`, is the composition root: the one place that reads the
whole `Config` (rank 0's `RankZero` too, for its side) and hands every component its own section, or what
`components.py` builds once from several (the engines' launch settings, the actor, reference and critic, the update's
settings); `run/preflight.py`'s `preflight` checks each section before anything starts.
"""
from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.config import Config
from megatron_cpo.rewards.non_finite import NonFiniteRewardError
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.modes import start_colocated
from megatron_cpo.trainer.components import critic_for, engine_launch_config, policies_for, policy_update_config
from megatron_cpo.trainer.driver.controller import CollectedBatch
from megatron_cpo.trainer.run.checkpointing import CheckpointError, CheckpointManager, hf_exporter
from megatron_cpo.trainer.run.errors import RunAbortedError
from megatron_cpo.trainer.run.machine import check_dtype
from megatron_cpo.trainer.run.run_guards import (
    StartupSignal,
    StopSignal,
    engines_lost_message,
    nothing_to_train_message,
    prepare_run_directory,
    rewards_refused_message,
    weights_not_finite_message,
)
from megatron_cpo.trainer.workers.collectives import (
    all_gather_object,
    any_rank,
    barrier,
    broadcast_batch,
    broadcast_object,
    push_weights,
)
from megatron_cpo.trainer.workers.offload import colocated_offload, offloaded_during
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


class Trainer:
    """One run on every rank. Construction initialises the process groups, starts rank 0's side (data, engines)
    and builds the actor and reference; `fit()` trains; `close()` releases everything (also after a failure)."""

    def __init__(self, config: Config, manager: RolloutEngines | None = None) -> None:
        self.config = config
        self.lead = None
        self.colocated_engines = None  # what this rank started for mode=colocate (rank 0: the manager), else None
        try:
            self._build(manager)
        except BaseException:
            self.close()  # what was started (rank 0's engines, a node's colocated engines) is stopped
            raise

    def _build(self, manager: RolloutEngines | None) -> None:
        from transformers import AutoTokenizer

        from megatron_cpo.trainer.driver.rank_zero import RankZero, announce_engines

        config = self.config
        model, actor_cfg, rollout = (config.actor_rollout_ref.model, config.actor_rollout_ref.actor,
                                     config.actor_rollout_ref.rollout)
        megatron = actor_cfg.megatron
        platform.init_distributed(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                                  seed=config.trainer.seed, context_parallel_size=megatron.context_parallel_size,
                                  expert_model_parallel_size=megatron.expert_model_parallel_size,
                                  expert_tensor_parallel_size=megatron.expert_tensor_parallel_size)
        prepare_run_directory(config.trainer)
        check_dtype(megatron.params_dtype)
        tokenizer = AutoTokenizer.from_pretrained(model.path)
        self.pad_token_id = tokenizer.pad_token_id
        launch = engine_launch_config(config)
        self.sync_probe = SyncProbe(rollout.sync_check, megatron.compute_dtype, launch.max_model_len, tokenizer,
                                    self.pad_token_id)
        self.update_config = policy_update_config(config)
        started = time.perf_counter()
        if dist.get_rank() == 0:
            announce_engines(rollout, model.path, manager is not None)
        if rollout.mode == "colocate" and broadcast_object(manager is None):
            # every node's first rank starts the engines on its node's devices; rank 0 drives them all
            manager, servers = start_colocated(rollout, launch, all_gather_object)
            self.colocated_engines = manager if manager is not None else servers
        if dist.get_rank() == 0:
            self.lead = RankZero(config, tokenizer, manager if manager is not None else launch)
            logger.info("data and rollout engines ready after %.0f s", time.perf_counter() - started)
            logger.info("building the Megatron actor (TP=%d, PP=%d, EP=%d, ETP=%d) from %s",
                        megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                        megatron.expert_model_parallel_size, megatron.expert_tensor_parallel, model.path)
        self.total_steps = broadcast_object(config.total_steps(len(self.lead.train_data)) if self.lead else None)
        updates = (self.total_steps * actor_cfg.ppo_epochs
                   * (config.data.train_batch_size // actor_cfg.ppo_mini_batch_size))
        self.actor, self.reference = policies_for(config, self.pad_token_id, updates)
        self.critic = critic_for(config, self.pad_token_id, self.total_steps)
        # colocated engines share the trainer's devices: the models' state goes to host memory while they generate
        self.offloads = (colocated_offload(self.actor, megatron, rollout.mode),
                         colocated_offload(self.critic, config.critic.megatron, rollout.mode, "critic.megatron")
                         if self.critic else None)
        controls = {"early_stop": self.lead.monitor, "samples": self.lead.samples} if self.lead else {}
        # the data position a checkpoint keeps is the controller's: the first prompt not yet trained
        self.checkpoints = CheckpointManager(
            Path(config.trainer.default_local_dir) / "checkpoints", self.actor,
            self.lead.controller if self.lead else None,
            {name: control for name, control in controls.items() if control is not None},
            hf_exporter(self.actor, model.path, megatron.compute_dtype) if actor_cfg.checkpoint.hf_model else None,
            config.trainer.max_actor_ckpt_to_keep, critic=self.critic,
            export_critic=hf_exporter(self.critic, config.critic.model.path or model.path, megatron.compute_dtype)
            if self.critic and config.critic.checkpoint.hf_model else None)

    # --- the run ---------------------------------------------------------------------------------------------
    def fit(self, stop: StopSignal) -> dict[str, float]:
        """Resume, validate, train until the last step (or data, early stop, SIGTERM); rank 0's last metrics."""
        lead, total = self.lead, self.total_steps
        start_step = self.checkpoints.maybe_resume(self.config.trainer.resume)
        if lead:
            lead.open_log(total, start_step)
        if broadcast_object(lead is not None and lead.monitor is not None and lead.monitor.stopped):
            if lead:
                logger.warning("not training: %s", lead.early_stop_reason(start_step))
            return {}
        if start_step >= total or broadcast_object(lead is not None and lead.samples.spent):
            if lead:
                budget = self.config.trainer.total_rollout_samples
                logger.warning("not training: the checkpoint of step %d already ends this run of %d steps%s (raise "
                               "trainer.total_training_steps%s to train on)", start_step, total,
                               f" and {budget} generated samples" if budget else "",
                               " or trainer.total_rollout_samples" if budget else "")
            return {}
        pushed = self.push_weights_or_abort(start_step)
        last: dict[str, float] = {}
        if self.config.trainer.val_before_train and start_step == 0:
            if lead:
                logger.info("validating before training (greedy, held-out prompts); then %d steps", total)
            last = self.validate()
            if lead:
                lead.metric_logger.log({**last, **sync_check_metrics(pushed.metrics)}, 0)
        step = start_step
        while step < total:
            outcome = self.step(step + 1, stop)
            if outcome is None:
                if step == start_step == 0:
                    raise ValueError(nothing_to_train_message(self.config.data.train_batch_size))
                logger.info("no batch at step %d (data exhausted); ending the run", step + 1)
                last.update(self._validate_after_exhaustion(step, start_step))
                break
            step += 1
            last = outcome.metrics
            if outcome.stop:
                logger.warning("stopped by SIGTERM after step %d; resume with trainer.resume=auto", step)
                return last
            if outcome.early_stopped:
                if lead:
                    logger.warning("%s", lead.early_stop_reason(step))
                break
            if outcome.budget_spent:
                if lead:
                    logger.info("the run has generated its %d samples (trainer.total_rollout_samples) after step %d",
                                self.config.trainer.total_rollout_samples, step)
                break
        if step > 0 and self.checkpoints.saved_step != step:
            self.checkpoints.save(step)  # the last (or early-stopped) step, whatever save_freq is
        return last

    def step(self, step: int, stop: StopSignal) -> StepOutcome | None:
        """One RL step (docs/architecture.md, "One RL step"); None when no batch could be formed (data ran out)."""
        lead, started = self.lead, time.perf_counter()
        collected = self.collect(step)                                                              # 1
        batch = broadcast_batch(lead.make_batch(collected) if lead else None)                       # 2
        if batch is None:
            return None
        settings = self.update_config
        log_probs = compute_log_probs(batch, self.actor, self.reference, settings, self.pad_token_id,   # 3
                                      self.critic)
        advantages, metrics = compute_advantages(batch, log_probs, settings)                        # 4
        if self.critic is not None:                                                                 # 5
            metrics.update(update_critic(self.critic, log_probs, settings))
        metrics.update(update_policy(self.actor, batch, log_probs, advantages, settings,
                                     train=step > settings.critic_warmup))
        if lead:
            self.sync_probe.observe_mismatch(step, metrics)
        pushed = self.push_weights(step)                                                            # 6
        metrics.update(pushed.metrics)
        self.sync_reference(step)                                                                   # 7
        early_stopped = self.observe_early_stop(collected, metrics)                                 # 8
        samples_due, budget_spent = broadcast_object(lead.count_samples(collected, metrics) if lead else None)
        stopping = any_rank(stop.received)
        healthy = pushed.lost is None and pushed.out_of_sync is None
        last = step == self.total_steps or early_stopped or budget_spent
        due = healthy and (samples_due or self._validation_due(step, last))
        validation = self.validate() if due else {}  # 9; the last step's row carries the final validation
        if lead:                                                                                    # 10
            metrics = lead.log_step(step, {**metrics, **validation}, collected, time.perf_counter() - started)
        self.abort_if_push_failed(step, pushed)
        self.abort_if_updates_skipped(step)
        # 11: metrics are logged before the checkpoint: a kill in between redoes the step (its rows are cut on resume),
        # while the other order would lose its metrics; the last step is saved by `fit`
        if stopping or self._save_due(step):
            self.checkpoints.save(step)
        return StepOutcome(metrics if lead else {}, stopping, early_stopped, budget_spent)

    # --- the step's parts ------------------------------------------------------------------------------------
    def collect(self, step: int) -> CollectedBatch | None:
        """Rank 0's kept groups for this step (None elsewhere); colocated, every rank's actor is offloaded meanwhile.
        When no engine is left, or a reward is not finite (`reward.non_finite=error`), every rank checkpoints the
        steps trained so far (with the actor back in place) and the run is aborted."""
        collected = lost = refused = None
        with offloaded_during(*self.offloads):
            if self.lead:
                try:
                    collected, lost = self.lead.collect(step)
                except NonFiniteRewardError as err:
                    refused = str(err)
            lost, refused = broadcast_object((lost is not None, refused))
        if refused is not None:
            raise RunAbortedError(rewards_refused_message(refused, step, self._checkpoint_before_abort(step - 1)))
        if lost:
            if self.rejoin_engines(step - 1):
                return self.collect(step)
            self.abort_engines_lost(step - 1)
        return collected

    def rejoin_engines(self, step: int) -> bool:
        """Every engine was lost during the rollout after step `step`, and some are restarting (rollout/manager.py):
        every rank pushes the weights of step `step` again, which they take (with the sync check) before the
        rollout is collected again; False when none is coming."""
        coming = broadcast_object(self.lead.manager.num_engines_restarting() if self.lead else None)
        if not coming:
            return False
        if self.lead:
            logger.warning("every rollout engine was lost during the rollout of step %d; the %d restarted engine(s) "
                           "take the weights of step %d before it is collected again", step + 1, coming, step)
        self.push_weights_or_abort(step)
        return True

    def push_weights(self, step: int) -> PushOutcome:
        """Push the actor's weights of step `step` to the live engines and check that they serve them
        (`sync_probe.py`). Rank 0 health-checks the engines first, so an engine that died since the last request
        is noticed here; its episodes in flight (which advance on their own thread) submit no turn meanwhile."""
        with self.lead.generation_held() if self.lead else nullcontext():
            return self._push_and_check(step)

    def _push_and_check(self, step: int) -> PushOutcome:
        from megatron_cpo.rollout import RolloutEnginesLostError

        manager = self.lead.manager if self.lead else None
        lost = None
        if manager is not None and manager.check_engines() == 0:
            lost = manager.last_engine_failure or "no engine answers"
        if broadcast_object(lost) is not None:
            return PushOutcome({}, lost=lost)
        alive = manager.num_engines_alive() if manager is not None else 0
        in_flight = self.config.async_training.in_flight
        hold = self.sync_probe.holds_paused_requests(in_flight)  # the probe runs before they go on
        try:
            metrics, reports = push_weights(self.actor.model, manager, in_flight, resume=not hold)
        except Exception as err:
            import ray  # only now: a sending rank must not import Ray before push_weights set its authentication mode

            # with one rank: an engine lost in a collective transfer leaves the survivors with a partial update, so
            # the run stops here too; with more, the other ranks are inside the transfer (no clean way back)
            if not isinstance(err, (RolloutEnginesLostError, ray.exceptions.RayError)) or dist.get_world_size() > 1:
                raise
            manager.check_engines()
            if manager.num_engines_alive() == alive:
                raise  # not an engine death
            return PushOutcome({}, lost=manager.last_engine_failure)
        try:
            metrics.update(self.sync_probe.after_push(step, self.actor, manager, reports, held=hold))
        except EngineOutOfSyncError as err:
            return PushOutcome({**metrics, **err.metrics}, out_of_sync=str(err),
                               trainer_not_finite=isinstance(err, TrainerNotFiniteError))
        return PushOutcome(metrics)

    def push_weights_or_abort(self, step: int) -> PushOutcome:
        pushed = self.push_weights(step)
        self.abort_if_push_failed(step, pushed)
        return pushed

    def abort_if_push_failed(self, step: int, pushed: PushOutcome) -> None:
        if pushed.lost is not None:
            self.abort_engines_lost(step)
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
                kept = f"checkpointed in {self._checkpoint_before_abort(step)} (resume with trainer.resume=auto once " \
                       "the cause is fixed)"
            except CheckpointError as err:  # the weights themselves are not finite: nothing is written
                kept = str(err)
            raise RunAbortedError(f"{guard.abort_message(step)}; {kept}")

    def sync_reference(self, step: int) -> None:
        """verl's `ref.sync_ref_model`: mix the actor into the reference every `ref_model_sync_steps` steps."""
        ref_cfg = self.config.actor_rollout_ref.ref
        if self.reference is not None and ref_cfg.sync_ref_model and step % ref_cfg.ref_model_sync_steps == 0:
            self.actor.mix_into(self.reference, ref_cfg.ref_model_mixup_alpha)

    def observe_early_stop(self, collected: CollectedBatch | None, metrics: dict[str, float]) -> bool:
        """Rank 0's reward-variance monitor decides; every rank learns whether the run ends after this step."""
        if not self.config.trainer.early_stop.enable:
            return False
        stopped = False
        if self.lead:
            stopped, monitor_metrics = self.lead.observe_early_stop(collected)
            metrics.update(monitor_metrics)
        return broadcast_object(stopped)

    def abort_engines_lost(self, step: int) -> None:
        """Checkpoint the `step` trained steps (unless already saved) and raise `RunAbortedError` on every rank."""
        saved = self._checkpoint_before_abort(step)
        manager = self.lead.manager if self.lead else None
        failure = manager.last_engine_failure if manager is not None else None
        engines = self.lead.engines() if self.lead else (0, 0)
        raise RunAbortedError(engines_lost_message(failure, engines, step, saved))

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
            metrics = self.lead.validate() if self.lead else {}
            if any(self.offloads):
                barrier()
        return metrics

    def _validation_due(self, step: int, last: bool) -> bool:
        freq = self.config.trainer.test_freq
        return last or (freq > 0 and step % freq == 0)

    def _save_due(self, step: int) -> bool:
        freq = self.config.trainer.save_freq
        return freq > 0 and step % freq == 0 and step < self.total_steps

    def _validate_after_exhaustion(self, step: int, start_step: int) -> dict[str, float]:
        """Rank 0's final validation when the data ran out (otherwise the last step's row has it)."""
        if step <= start_step:
            return {}
        final = self.validate()
        if self.lead and final:
            self.lead.metric_logger.log(final, step)
        return final

    def close(self) -> None:
        try:
            if self.lead is not None:
                self.lead.close()
        finally:
            if self.colocated_engines is not None:
                self.colocated_engines.shutdown()


def run_training(config: Config, manager: RolloutEngines | None = None, checked: bool = False) -> dict[str, float]:
    """Train as configured; returns rank 0's last logged metrics (empty dict on other ranks).

    `manager`: already running engines (`RolloutEngines`) to use on rank 0 (left running); by default they are started.
    The engines always receive the actor's weights before the first rollout, so they may have served anything.
    SIGTERM during start-up raises `RunAbortedError` after the engines are stopped.
    `checked`: the caller already ran `preflight(config)` (the `train` command does, before it opens the run's log).
    """
    from megatron_cpo.trainer.run.preflight import preflight

    if not checked:
        preflight(config)  # model, layout, data, graders, output folder, sinks: fail before anything starts or loads
    startup = StartupSignal()
    trainer = stop = None
    try:
        trainer = Trainer(config, manager)
        startup.check()
        startup.restore()
        stop = StopSignal()
        return trainer.fit(stop)
    except BaseException as err:
        if startup.received and not isinstance(err, RunAbortedError):
            raise startup.error() from err  # the signal's exception, as it surfaced (see StartupSignal)
        raise
    finally:
        startup.restore()
        if stop is not None:
            stop.restore()
        if trainer is not None:
            trainer.close()
        platform.destroy_distributed()
