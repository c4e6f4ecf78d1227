"""The training run: SPMD under torchrun, rank 0 also drives the rollout engines.

One step (ARCHITECTURE.md, "One training step"):
1-3. rank 0's controller streams groups from the engines, scores and filters them until the batch is full;
4-6. the batch is broadcast and every rank scores it (actor, hint, reference), shapes advantages and updates;
7.   the new weights go to the engines, metrics are logged, a checkpoint is written when due (or on SIGTERM), and
     always after the last step.
`val/acc` (greedy accuracy on the held-out set) is logged before the first step and with the last. With
`trainer.early_stop.enable` the run also ends (checkpointed, reason logged) once the reward variance has collapsed.
"""
from __future__ import annotations

import logging
import math
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.algorithms.filters import EarlyStopConfig as MonitorConfig
from megatron_cpo.algorithms.filters import EarlyStopMonitor
from megatron_cpo.config import Config, config_to_dict
from megatron_cpo.trainer.checkpointing import CheckpointManager
from megatron_cpo.trainer.errors import RunAbortedError
from megatron_cpo.trainer.loggers import MetricLogger
from megatron_cpo.trainer.run_guards import StartupSignal, engines_lost_message, prepare_run_directory
from megatron_cpo.trainer.step import broadcast_batch, make_step_batch, train_on_batch
from megatron_cpo.trainer.workers import build_policies

logger = logging.getLogger(__name__)


class StopSignal:
    """Remembers a SIGTERM (SLURM preemption) so the loop can checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        logger.warning("SIGTERM received: finishing this step, then checkpointing and stopping")
        self.received = True

    def agreed(self) -> bool:
        """Whether any rank was signalled (collective)."""
        flag = torch.tensor([float(self.received)], device=platform.device())  # NCCL reduces device tensors only
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


def _hf_exporter(config: Config, actor: Any) -> Callable[[Path], Any]:
    """Collective: writes the actor as a Hugging Face model directory (config and tokenizer from the model path)."""
    from megatron_cpo.models.converters import export_hf_model

    dtype = getattr(torch, config.actor_rollout_ref.actor.megatron.params_dtype)
    return lambda out: export_hf_model(actor.model, actor.model.hf_config, config.actor_rollout_ref.model.path, out,
                                       dtype=dtype)


def _total_steps(config: Config, num_prompts: int) -> int:
    if config.trainer.total_training_steps:
        return config.trainer.total_training_steps
    return config.trainer.total_epochs * math.ceil(num_prompts / config.data.train_batch_size)


def _broadcast(value: Any) -> Any:
    payload = [value]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _batch_reward_metrics(groups: list) -> dict[str, float]:
    """ms-swift's reward, reward_std (mean in-group std), frac_reward_zero_std, and acc over the trained batch."""
    scores = torch.stack([g.scores.float() for g in groups])
    acc = torch.stack([g.acc.float() for g in groups])
    group_std = scores.std(dim=1, unbiased=False)
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std(unbiased=False)),
            "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "reward_std": float(group_std.mean()), "frac_reward_zero_std": float((group_std == 0).float().mean()),
            "reward/acc": float(acc.mean())}


def _early_stop_monitor(config: Config, is_rank0: bool) -> EarlyStopMonitor | None:
    """Rank 0's reward-variance monitor when `trainer.early_stop.enable` (None elsewhere or when off)."""
    cfg = config.trainer.early_stop
    if not (cfg.enable and is_rank0):
        return None
    return EarlyStopMonitor(MonitorConfig(baseline_steps=cfg.baseline_steps, window=cfg.window, ratio=cfg.ratio))


def _early_stop_reason(monitor: EarlyStopMonitor, step: int) -> str:
    cfg = monitor.config
    return (f"early stop after step {step}: the last {cfg.window} values of rollout/in_group_reward_std were all "
            f"below {cfg.ratio} x the baseline {monitor.baseline:.4g} (mean of the first {cfg.baseline_steps} steps); "
            "the rewards no longer separate the responses of a prompt. A checkpoint was written; to train on, resume "
            "with trainer.early_stop.enable=false")


def run_training(config: Config, manager: Any = None, checked: bool = False) -> dict[str, float]:
    """Train as configured; returns rank 0's last logged metrics (empty dict on other ranks).

    `manager`: an already running `RolloutManager` to use on rank 0 (left running); by default engines are started.
    The engines always receive the actor's weights before the first rollout, so they may have served anything.
    The last step is always checkpointed; a run that loses every rollout engine checkpoints what it trained and
    raises `RunAbortedError` (one line naming the engine and the fix), as does SIGTERM during start-up.
    `checked`: the caller already ran `preflight(config)` (the `train` command does, before it opens the run's log).
    """
    from megatron_cpo.trainer.preflight import preflight

    if not checked:
        preflight(config)  # model, layout, data, graders, output folder, sinks: fail before anything starts or loads
    from transformers import AutoTokenizer

    from megatron_cpo.trainer.rollout_side import RolloutSide

    startup = StartupSignal()
    side = metric_logger = stop = None
    megatron = config.actor_rollout_ref.actor.megatron
    try:
        platform.init_distributed(megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                                  seed=config.trainer.seed, context_parallel_size=megatron.context_parallel_size)
        prepare_run_directory(config)
        is_rank0 = dist.get_rank() == 0
        tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
        started = time.perf_counter()
        if is_rank0:
            _announce_engines(config, manager is not None)
        side = RolloutSide(config, tokenizer, manager) if is_rank0 else None
        if is_rank0:
            logger.info("data and rollout engines ready after %.0f s", time.perf_counter() - started)
        total_steps = _broadcast(_total_steps(config, len(side.train_data)) if is_rank0 else None)
        actor_cfg = config.actor_rollout_ref.actor
        updates = total_steps * actor_cfg.ppo_epochs * (config.data.train_batch_size // actor_cfg.ppo_mini_batch_size)
        if is_rank0:
            logger.info("building the Megatron actor (TP=%d, PP=%d) from %s", megatron.tensor_model_parallel_size,
                        megatron.pipeline_model_parallel_size, config.actor_rollout_ref.model.path)
        actor, reference = build_policies(config, tokenizer.pad_token_id, updates)
        out_dir = Path(config.trainer.default_local_dir)
        monitor = _early_stop_monitor(config, is_rank0)
        checkpoints = CheckpointManager(out_dir / "checkpoints", actor, side.stream if side else None,
                                        {"early_stop": monitor} if monitor is not None else None,
                                        _hf_exporter(config, actor) if actor_cfg.checkpoint.hf_model else None)
        start_step = checkpoints.maybe_resume(config.trainer.resume)
        early_stopped = _broadcast(monitor is not None and monitor.stopped)
        metric_logger = (MetricLogger(config.trainer.logger, out_dir, total_steps, config.trainer.project_name,
                                      config.trainer.experiment_name, config_to_dict(config),
                                      config.trainer.log_verl_metric_names,
                                      config.actor_rollout_ref.rollout.val_kwargs.n, resume_step=start_step)
                         if is_rank0 else None)
        startup.check()
        startup.restore()
        stop = StopSignal()
        last: dict[str, float] = {}
        if early_stopped:
            if is_rank0:
                logger.warning("not training: %s", _early_stop_reason(monitor, start_step))
            return last
        if start_step >= total_steps:
            if is_rank0:
                logger.warning("not training: the checkpoint of step %d already ends this %d-step run (raise "
                               "trainer.total_training_steps to train on)", start_step, total_steps)
            return last
        _push_weights_or_abort(actor.model, side, checkpoints, start_step)
        if is_rank0 and config.trainer.val_before_train and start_step == 0:
            logger.info("validating before training (greedy, held-out prompts); then %d steps", total_steps)
            last = _validate(side)
            metric_logger.log(last, 0)
        step, exhausted = start_step, False
        while step < total_steps:
            step += 1
            step_start = time.perf_counter()
            collected = _collect_or_abort(side, step, checkpoints)
            batch = None
            if collected is not None and collected.groups and (
                    collected.full or config.algorithm.filter_groups.on_limit == "use_partial"):
                kept_ratio = collected.metrics["filter/kept_ratio"]
                hints = side.hint_contexts if config.algorithm.adv_estimator == "cpo" else None
                batch = make_step_batch(collected.groups, kept_ratio, hints)
            batch = broadcast_batch(batch)
            if batch is None:
                if step == 1 and start_step == 0:
                    raise ValueError(nothing_to_train_message(config))
                logger.info("no batch at step %d (data exhausted); ending the run", step)
                step -= 1
                exhausted = True
                break
            metrics = train_on_batch(batch, actor, reference, config, tokenizer.pad_token_id)
            pushed, lost = _push_weights(actor.model, side)
            metrics.update(pushed)
            ref_cfg = config.actor_rollout_ref.ref
            if reference is not None and ref_cfg.sync_ref_model and step % ref_cfg.ref_model_sync_steps == 0:
                actor.mix_into(reference, ref_cfg.ref_model_mixup_alpha)
            if monitor is not None:
                early_stopped = monitor.observe(collected.metrics["rollout/in_group_reward_std"], successful=True)
                metrics.update({"train/early_stopped": float(early_stopped),
                                "early_stop/baseline": monitor.baseline if monitor.baseline is not None else 0.0})
            if config.trainer.early_stop.enable:
                early_stopped = _broadcast(early_stopped)
            stopping = stop.agreed()
            if is_rank0:
                metrics.update(collected.metrics)
                metrics.update(_batch_reward_metrics(collected.groups))
                metrics.update(side.remote_reward_metrics())
                metrics["rollout/engines_alive"] = float(side.manager.num_engines_alive())
                seconds = time.perf_counter() - step_start
                metrics.update({"timing/step_s": seconds,
                                "timing/tokens_per_s": metrics["timing/generated_tokens"] / seconds,
                                "train/epoch": float(side.stream.epoch)})
                # the last step's row carries the final validation, so every step is one row of metrics.jsonl
                if not lost and (step == total_steps or early_stopped or (
                        config.trainer.test_freq > 0 and step % config.trainer.test_freq == 0)):
                    metrics.update(_validate(side))
                metric_logger.log(metrics, step)
                _log_completions(metric_logger, collected.groups, config.trainer.log_completions, step)
                last = metrics
            if lost is not None:
                _abort_engines_lost(side, checkpoints, step)
            # metrics are logged before the checkpoint: a kill in between redoes the step (its rows are cut on
            # resume), while the other order would lose its metrics; the last step is saved after the loop
            if stopping or (config.trainer.save_freq > 0 and step % config.trainer.save_freq == 0
                            and step < total_steps):
                checkpoints.save(step)
            if stopping:
                logger.warning("stopped by SIGTERM after step %d; resume with trainer.resume=auto", step)
                return last
            if early_stopped:
                if is_rank0:
                    logger.warning("%s", _early_stop_reason(monitor, step))
                break
        step_done = _broadcast(step)
        if is_rank0 and exhausted and step_done > start_step:  # otherwise the last step's row has it
            final = _validate(side)
            if final:
                metric_logger.log(final, step_done)
                last = {**last, **final}
        if step_done > 0 and checkpoints.saved_step != step_done:
            checkpoints.save(step_done)  # the last (or early-stopped) step, whatever save_freq is
        return last
    except BaseException as err:
        if startup.received and not isinstance(err, RunAbortedError):
            raise startup.error() from err  # the signal's exception, as it surfaced (see StartupSignal)
        raise
    finally:
        startup.restore()
        if stop is not None:
            stop.restore()
        if metric_logger is not None:
            metric_logger.close()
        if side is not None:
            side.close()
        platform.destroy_distributed()


def _validate(side: Any) -> dict[str, float]:
    """Rank 0's validation metrics; {} (with a warning) when the engines were lost meanwhile, so the step's
    checkpoint is still written and the next rollout ends the run with the full message."""
    from megatron_cpo.rollout import RolloutEnginesLostError

    try:
        return side.validate()
    except RolloutEnginesLostError as err:
        logger.warning("validation skipped: %s", err)
        return {}


def _collect_or_abort(side: Any, step: int, checkpoints: CheckpointManager) -> Any:
    """Collective: rank 0 collects step `step`'s groups (None elsewhere). When no engine is left, the data position
    goes back to the start of the step, the steps trained so far are checkpointed and the run is aborted."""
    from megatron_cpo.rollout import RolloutEnginesLostError

    collected, lost = None, None
    if side is not None:
        position = side.stream.state_dict()
        try:
            collected = side.controller.collect(step)
        except RolloutEnginesLostError as err:
            side.stream.load_state_dict(position)
            lost = str(err)
    if _broadcast(lost is not None):
        _abort_engines_lost(side, checkpoints, step - 1)
    return collected


def _push_weights(actor_model: Any, side: Any) -> tuple[dict[str, float], str | None]:
    """Collective: push the actor's weights to the live engines; (metrics, None), or ({}, why) when none is left.
    Rank 0 health-checks the engines first, so an engine that died since the last request is noticed here."""
    from megatron_cpo.rollout import RolloutEnginesLostError
    from megatron_cpo.trainer.rollout_side import push_weights

    lost = None
    if side is not None and side.manager.check_engines() == 0:
        lost = side.manager.last_engine_failure or "no engine answers"
    if _broadcast(lost) is not None:
        return {}, lost
    alive = side.manager.num_engines_alive() if side is not None else 0
    try:
        return push_weights(actor_model, side), None
    except Exception as err:
        import ray  # only now: a sending rank must not import Ray before push_weights set its authentication mode

        # with one rank: an engine that died during the transfer leaves the survivors with a partial update, so
        # the run stops here too; with more, the other ranks are inside the transfer (no clean way back)
        if (not isinstance(err, (RolloutEnginesLostError, ray.exceptions.RayError)) or dist.get_world_size() > 1
                or side.manager.check_engines() == alive):
            raise  # not an engine death
        return {}, side.manager.last_engine_failure


def _push_weights_or_abort(actor_model: Any, side: Any, checkpoints: CheckpointManager, step: int) -> None:
    if _push_weights(actor_model, side)[1] is not None:
        _abort_engines_lost(side, checkpoints, step)


def _abort_engines_lost(side: Any, checkpoints: CheckpointManager, step: int) -> None:
    """Collective: checkpoint the `step` trained steps (unless already saved) and raise `RunAbortedError`."""
    saved = None
    if step > 0:
        saved = checkpoints.root / f"step_{step:06d}"
        if checkpoints.saved_step != step:
            saved = checkpoints.save(step)
    failure = side.manager.last_engine_failure if side is not None else None
    engines = (side.manager.num_engines_alive(), len(side.manager.engines)) if side is not None else (0, 0)
    raise RunAbortedError(engines_lost_message(failure, engines, step, saved))


def nothing_to_train_message(config: Config) -> str:
    """Why a run that has not trained a single step stops (instead of exiting 0 with nothing done)."""
    return ("no training batch could be formed at step 1: the filters dropped every group before "
            f"data.train_batch_size={config.data.train_batch_size} were kept (e.g. every response scored the same "
            "because the ground truths are empty or the task is too easy/hard); check the data's "
            "reward_model.ground_truth and the grader, or relax algorithm.filter_groups / the rollout filter")


def _announce_engines(config: Config, given: bool) -> None:
    """Say what the slow part of start-up is doing (data, engines) before it happens."""
    rollout = config.actor_rollout_ref.rollout
    if given:
        logger.info("loading data; using the rollout engines passed in")
    else:
        logger.info("loading data and starting %d vLLM engine(s) for %s (tens of seconds)",
                    rollout.num_engines, config.actor_rollout_ref.model.path)


def _log_completions(metric_logger: MetricLogger, groups: list, rows: int, step: int) -> None:
    """Write up to `rows` prompt / completion / reward rows of this step to completions.jsonl."""
    if rows <= 0:
        return
    table = []
    for group in groups:
        for text, score, acc in zip(group.response_texts, group.scores.tolist(), group.acc.tolist()):
            table.append({"prompt": group.record.messages[-1]["content"], "completion": text, "score": score,
                          "acc": acc})
    metric_logger.log_table("completions", table[:rows], step)
