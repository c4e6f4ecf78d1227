"""The composition root of a training run: the one place (with `megatron_cpo/config.py`, `command.py` and the
`LeadDriver` construction) that reads the whole `Config`, builds the `Trainer`'s typed parts and hands each its own
section or what `components.py` builds from several. `run_training(config)` is the entry point: preflight
(`run/preflight.py`), build, `Trainer.fit`, close (also after a failure).
"""
from __future__ import annotations

import logging
import time
from contextlib import ExitStack
from pathlib import Path

import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.config import Config
from megatron_cpo.rollout.engine_teacher import EngineTeacher
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.modes import start_colocated
from megatron_cpo.trainer.collectives import all_gather_object, broadcast_object
from megatron_cpo.trainer.components import (
    critic_for,
    engine_launch_config,
    policies_for,
    run_settings,
    trainer_teacher,
)
from megatron_cpo.trainer.driver.follower import FollowerDriver
from megatron_cpo.trainer.driver.lead import LeadDriver, announce_engines
from megatron_cpo.trainer.loop import Trainer
from megatron_cpo.trainer.run.checkpointing import CheckpointManager, hf_exporter
from megatron_cpo.trainer.run.errors import RunAbortedError
from megatron_cpo.trainer.run.machine import check_dtype
from megatron_cpo.trainer.run.run_guards import StartupSignal, StopSignal, prepare_run_directory
from megatron_cpo.trainer.workers.offload import colocated_offload
from megatron_cpo.trainer.workers.sync_probe import SyncProbe

logger = logging.getLogger(__name__)


def build_trainer(config: Config, manager: RolloutEngines | None = None,
                  teachers: dict[str, EngineTeacher] | None = None) -> Trainer:
    """Initialise the process groups, start rank 0's side (data, engines, distillation's engine teachers unless
    `teachers` gives them by name) as its `LeadDriver` (the other ranks get a `FollowerDriver`), build the actor,
    reference, critic and a distillation teacher in the trainer, and return the `Trainer` on every rank. What was
    started is stopped again when a later part fails."""
    from transformers import AutoTokenizer

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
    launch = engine_launch_config(config)
    sync_probe = SyncProbe(rollout.sync_check, megatron.compute_dtype, launch.max_model_len, tokenizer,
                           tokenizer.pad_token_id)
    lead, started = dist.get_rank() == 0, time.perf_counter()
    with ExitStack() as started_parts:  # closed only when a part fails: the trainer owns them afterwards
        if lead:
            announce_engines(rollout, model.path, manager is not None)
        colocated = None  # what this rank starts for mode=colocate (rank 0: the manager), else None
        if rollout.mode == "colocate" and broadcast_object(manager is None):
            # every node's first rank starts the engines on its node's devices; rank 0 drives them all
            manager, servers = start_colocated(rollout, launch, all_gather_object)
            colocated = manager if manager is not None else servers
            if colocated is not None:
                started_parts.callback(colocated.shutdown)
        engines = manager if manager is not None else launch  # rank 0 starts them unless given or colocated
        driver = LeadDriver(config, tokenizer, engines, teachers) if lead else FollowerDriver()
        started_parts.callback(driver.close)
        if lead:
            logger.info("data and rollout engines ready after %.0f s", time.perf_counter() - started)
            logger.info("building the Megatron actor (TP=%d, PP=%d, EP=%d, ETP=%d) from %s",
                        megatron.tensor_model_parallel_size, megatron.pipeline_model_parallel_size,
                        megatron.expert_model_parallel_size, megatron.expert_tensor_parallel, model.path)
        settings = run_settings(config, config.total_steps(driver.train_prompts()))
        updates = (settings.total_steps * actor_cfg.ppo_epochs
                   * (config.data.train_batch_size // actor_cfg.ppo_mini_batch_size))
        actor, reference = policies_for(config, tokenizer.pad_token_id, updates)
        critic = critic_for(config, tokenizer.pad_token_id, settings.total_steps)
        teacher = trainer_teacher(config, actor, tokenizer.pad_token_id)
        # colocated engines share the trainer's devices: the models' state goes to host memory while they generate
        offloads = (colocated_offload(actor, megatron, rollout.mode),
                    colocated_offload(critic, config.critic.megatron, rollout.mode, "critic.megatron")
                    if critic else None)
        # the data position a checkpoint keeps is the controller's: the first prompt not yet trained
        data_position, controls = driver.checkpointed()
        checkpoints = CheckpointManager(
            Path(config.trainer.default_local_dir) / "checkpoints", actor, data_position, controls,
            hf_exporter(actor, model.path, megatron.compute_dtype) if actor_cfg.checkpoint.hf_model else None,
            config.trainer.max_actor_ckpt_to_keep, critic=critic,
            export_critic=hf_exporter(critic, config.critic.model.path or model.path, megatron.compute_dtype)
            if critic and config.critic.checkpoint.hf_model else None)
        trainer = Trainer(driver=driver, actor=actor, reference=reference, critic=critic, offloads=offloads,
                          checkpoints=checkpoints, sync_probe=sync_probe, settings=settings,
                          pad_token_id=tokenizer.pad_token_id, started_engines=colocated, teacher=teacher)
        started_parts.pop_all()
    return trainer


def run_training(config: Config, manager: RolloutEngines | None = None, checked: bool = False,
                 teachers: dict[str, EngineTeacher] | None = None) -> dict[str, float]:
    """Train as configured; returns rank 0's last logged metrics (empty dict on other ranks).

    `manager`: already running engines (`RolloutEngines`) to use on rank 0 (left running); by default they are started.
    `teachers`: distillation's engine teachers already running, by `distillation.teacher_models` name (left
    running); by default they are started.
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
        trainer = build_trainer(config, manager, teachers)
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
