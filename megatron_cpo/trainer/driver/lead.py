"""Rank 0's driver: data, engines, the controller, grading, validation, run controls and logging.

`LeadDriver` does the work of every method of the driver interface (`interface.py`) and broadcasts what the other
ranks' `FollowerDriver` receives (`trainer/collectives.py`). Engines passed in (already running, e.g. shared by tests
or a notebook) are used and left running; given the run's `EngineLaunchConfig` instead, the engines are started here.
Its construction is rank 0's part of the composition root: it reads the `Config` once, hands each component its own
section and keeps no `Config`.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from functools import partial
from pathlib import Path
from typing import Any

import torch

from megatron_cpo.algorithms.cpo_rules import CPOConfig
from megatron_cpo.algorithms.early_stop import EarlyStopMonitor
from megatron_cpo.config import Config, config_to_dict
from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.metrics import episode_metrics
from megatron_cpo.envs.registry import EnvironmentRegistry
from megatron_cpo.envs.runner import EpisodeRunner
from megatron_cpo.rewards.non_finite import NonFiniteRewardError
from megatron_cpo.rewards.sandbox_types import SandboxConfig
from megatron_cpo.rollout.config import RolloutConfig
from megatron_cpo.rollout.engine_teacher import EngineTeacher
from megatron_cpo.rollout.generators import GreedyBaselineGenerator, GroupGenerator, SingleTurnGenerator
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.modes import build_rollout_manager
from megatron_cpo.rollout.teacher_config import DistillationConfig
from megatron_cpo.rollout.teachers import TeacherScoreError
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEnginesLostError
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.collectives import broadcast_batch, broadcast_object
from megatron_cpo.trainer.driver.accumulator import group_selection
from megatron_cpo.trainer.driver.admission import admission_for
from megatron_cpo.trainer.driver.batching import make_step_batch
from megatron_cpo.trainer.driver.controller import CollectedBatch, RolloutController, prompt_limit
from megatron_cpo.trainer.driver.grading import ResponseScorer
from megatron_cpo.trainer.driver.interface import CollectOutcome, Driver, StepControls
from megatron_cpo.trainer.driver.loggers import MetricLogger
from megatron_cpo.trainer.driver.mismatch_watch import MismatchWatch
from megatron_cpo.trainer.driver.prompt_stream import PromptStream
from megatron_cpo.trainer.driver.rollout_side import HintContextBuilder, training_sampling_params
from megatron_cpo.trainer.driver.sample_budget import SampleBudget
from megatron_cpo.trainer.driver.teacher_feed import TeacherBatch, start_teacher_feed
from megatron_cpo.trainer.driver.validation import Validator

logger = logging.getLogger(__name__)


class LeadDriver(Driver):
    """Rank 0's side of a run (step numbers of docs/architecture.md, "One RL step"): `collect` fills a batch (1),
    `make_batch` flattens and broadcasts it (2), `observe_controls` feeds the early-stop monitor and the sample
    count (8), `validate` (9) and `log_step` writes the step's metrics (10); `open` starts the metric sinks once the
    resume step is known."""

    def __init__(self, config: Config, tokenizer: Any, engines: RolloutEngines | EngineLaunchConfig,
                 teachers: dict[str, EngineTeacher] | None = None) -> None:
        data, rollout, algorithm, trainer = (config.data, config.actor_rollout_ref.rollout, config.algorithm,
                                             config.trainer)
        needs_ground_truth = config.reward.needs_ground_truth
        self.train_data = PromptDataset(data.train_files, tokenizer, data, needs_ground_truth=needs_ground_truth)
        val_data = (PromptDataset(data.val_files, tokenizer, data, needs_ground_truth=needs_ground_truth)
                    if data.val_files else None)
        self.stream = PromptStream(self.train_data, trainer.total_epochs, trainer.seed, data.shuffle)
        self.owns_engines = isinstance(engines, EngineLaunchConfig)
        # rollout.mode: ray, server or colocate
        self.engines = build_rollout_manager(rollout, engines) if self.owns_engines else engines
        self.sampler = make_generator(rollout.multi_turn, config.reward.sandbox, self.engines, tokenizer, data)
        # ReMax: each prompt's greedy answer too, as its baseline (validation samples without it)
        self.generator = (GreedyBaselineGenerator(self.sampler) if algorithm.estimator_needs.greedy_baseline
                          else self.sampler)
        self.scorer = ResponseScorer(config.reward, tokenizer)
        # distillation's engine teachers (`teachers`: already running ones by name, left running), after the engines
        self.teachers = start_teacher_feed(
            config.distillation, teachers, config.actor_rollout_ref.actor.megatron.compute_dtype,
            data.max_prompt_length + data.max_response_length + 1, trainer.seed, rollout.ray_address,
            rollout.server_timeout_s)
        eos = tokenizer.eos_token_id
        shaper = algorithm.shaper
        self.hints = (HintContextBuilder(algorithm.cpo, data, tokenizer, shaper.hinted_responses)
                      if shaper.needs_hint_contexts else self_teacher_hints(config.distillation, data, tokenizer))
        selection = group_selection(algorithm.filter_groups, rollout, config.reward.overlong_buffer,
                                    data.train_batch_size, data.max_response_length)
        # with engine teachers, each finished group is submitted to its teacher before the controller sees it
        generator = self.teachers.watching(self.generator) if self.teachers is not None else self.generator
        self.controller = RolloutController(
            generator, self.stream, self.scorer.score_groups,
            admission_for(config.async_training, data.train_batch_size, rollout.max_inflight_prompts), selection,
            lambda seed: training_sampling_params(rollout, data.max_response_length, eos, seed), data,
            algorithm.filter_groups, prompt_limit(algorithm.filter_groups, rollout, data.generation_batch_size))
        # with asynchronous training, validation shares the engines with training requests in flight
        self.validator = Validator(val_data, self.sampler, self.scorer,
                                   training_sampling_params(rollout, data.max_response_length, eos, None, greedy=True),
                                   rollout.val_kwargs, trainer.seed, data.val_max_samples, self.controller.receive)
        self.monitor = EarlyStopMonitor(trainer.early_stop) if trainer.early_stop.enable else None
        self.samples = SampleBudget(trainer.total_rollout_samples, trainer.test_freq_samples)
        self.mismatch = MismatchWatch(rollout.sync_check, config.actor_rollout_ref.actor.megatron.compute_dtype)
        self.completion_rows = trainer.log_completions
        # the sinks start in `open`, once the run's length and resume step are known
        self.metric_sinks = partial(MetricLogger, trainer.logger, Path(trainer.default_local_dir),
                                    project=trainer.project_name, name=trainer.experiment_name,
                                    config=config_to_dict(config), verl_names=trainer.log_verl_metric_names,
                                    val_samples=rollout.val_kwargs.n)
        self.metric_logger: MetricLogger | None = None

    # --- before training ----------------------------------------------------------------------------------------
    def train_prompts(self) -> int:
        return broadcast_object(len(self.train_data))

    def checkpointed(self) -> tuple[RolloutController, dict[str, Any]]:
        controls = {"early_stop": self.monitor, "samples": self.samples}
        return self.controller, {name: control for name, control in controls.items() if control is not None}

    def open(self, total_steps: int, start_step: int) -> str | None:
        self.metric_logger = self.metric_sinks(total_steps=total_steps, resume_step=start_step)
        reason = None
        if self.monitor is not None and self.monitor.stopped:
            reason = self.early_stop_reason(start_step)
        elif start_step >= total_steps or self.samples.spent:
            budget = self.samples.total
            reason = (f"the checkpoint of step {start_step} already ends this run of {total_steps} steps"
                      f"{f' and {budget} generated samples' if budget else ''} (raise trainer.total_training_steps"
                      f"{' or trainer.total_rollout_samples' if budget else ''} to train on)")
        if reason is not None:
            logger.warning("not training: %s", reason)
        return broadcast_object(reason)

    def announce(self, message: str, *args: Any) -> None:
        logger.info(message, *args)

    # --- steps 1-2: collect, flatten and broadcast --------------------------------------------------------------
    def collect(self, step: int) -> CollectOutcome:
        outcome = self.collect_groups(step)
        broadcast_object((outcome.engines_lost, outcome.rewards_refused, outcome.engines_restarting,
                          outcome.teacher_refused))
        return outcome

    def collect_groups(self, step: int) -> CollectOutcome:
        """This step's kept groups with their engine teachers' scores, or why there are none: no engine left, a
        reward or a teacher's log-prob not finite; then the data position goes back to the first prompt not yet
        trained, so a resumed run (or this step collected again once restarted engines took the weights) collects
        the same prompts: what was outstanding is dropped."""
        position = self.controller.state_dict()
        try:
            collected = self.controller.collect(step, self.engines.weight_version)
            teacher = (self.teachers.collect(collected.groups)
                       if self.teachers is not None and collected.groups and collected.trainable else None)
            return CollectOutcome(collected, teacher=teacher)
        except RolloutEnginesLostError as err:
            self.generator.cancel_all()
            self.controller.load_state_dict(position)
            coming = self.engines.num_engines_restarting()
            if coming:
                logger.warning("every rollout engine was lost during the rollout of step %d; the %d restarted "
                               "engine(s) take the weights of step %d before it is collected again", step, coming,
                               step - 1)
            return CollectOutcome(None, engines_lost=str(err), engines_restarting=coming)
        except NonFiniteRewardError as err:
            self.controller.load_state_dict(position)
            return CollectOutcome(None, rewards_refused=str(err))
        except TeacherScoreError as err:
            self.controller.load_state_dict(position)
            return CollectOutcome(None, teacher_refused=str(err))

    def make_batch(self, outcome: CollectOutcome) -> StepBatch | None:
        return broadcast_batch(self.build_batch(outcome.collected, outcome.teacher))

    def build_batch(self, collected: CollectedBatch | None, teacher: TeacherBatch | None = None) -> StepBatch | None:
        """The kept groups as a `StepBatch` (with CPO's or the self teacher's hint contexts, and the engine
        teachers' scores), or None when there is nothing to train on."""
        if collected is None or not collected.groups or not collected.trainable:
            return None
        return make_step_batch(collected.groups, collected.metrics["filter/kept_ratio"], self.hints,
                               collected.policy_version, teacher.scores if teacher is not None else None)

    # --- step 6: the engines around the weight push -------------------------------------------------------------
    def watch_mismatch(self, step: int, metrics: dict[str, float]) -> None:
        self.mismatch.observe(step, metrics)

    def generation_held(self) -> AbstractContextManager[None]:
        """Episodes advance on their own thread (envs/runner.py) and submit no turn while held; single answers are
        submitted by the controller alone, so there is nothing to hold."""
        return self.generator.held() if isinstance(self.generator, EpisodeRunner) else nullcontext()

    def check_engines(self) -> str | None:
        lost = None
        if self.engines.check_engines() == 0:
            lost = self.engines.last_engine_failure or "no engine answers"
        return broadcast_object(lost)

    def engine_counts(self) -> tuple[int, int]:
        return self.engines.num_engines_alive(), len(self.engines.engines)

    def engine_failure(self) -> str | None:
        return self.engines.last_engine_failure

    # --- step 8: early stop and the sample budget ---------------------------------------------------------------
    def observe_controls(self, outcome: CollectOutcome) -> StepControls:
        """Feed the reward-variance monitor (with `trainer.early_stop.enable`) and add the step's generated samples
        to the run's count (`train/generated_samples`)."""
        collected, metrics, stopped = outcome.collected, {}, False
        if self.monitor is not None:
            stopped = self.monitor.observe(collected.metrics["rollout/in_group_reward_std"], successful=True)
            baseline = self.monitor.baseline
            metrics = {"train/early_stopped": float(stopped),
                       "early_stop/baseline": baseline if baseline is not None else 0.0}
        due = self.samples.add(int(collected.metrics["rollout/generated_samples"]))
        metrics["train/generated_samples"] = float(self.samples.generated)
        flags = broadcast_object((stopped, due, self.samples.spent))
        return StepControls(*flags, metrics=metrics)

    def early_stop_reason(self, step: int) -> str:
        cfg = self.monitor.config
        return (f"early stop after step {step}: the last {cfg.window} values of rollout/in_group_reward_std were "
                f"all below {cfg.ratio} x the baseline {self.monitor.baseline:.4g} (mean of the first "
                f"{cfg.baseline_steps} steps); the rewards no longer separate the responses of a prompt. A checkpoint "
                "was written; to train on, resume with trainer.early_stop.enable=false")

    # --- steps 9-10: validation, metrics ------------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Validation metrics; {} (with a warning) when the engines were lost meanwhile, so the step's checkpoint
        is still written and the next rollout ends the run with the full message."""
        try:
            return self.validator.validate()
        except RolloutEnginesLostError as err:
            logger.warning("validation skipped: %s", err)
            return {}

    def log_step(self, step: int, metrics: dict[str, float], outcome: CollectOutcome, seconds: float
                 ) -> dict[str, float]:
        collected = outcome.collected
        metrics = {**metrics, **collected.metrics, **batch_reward_metrics(collected.groups),
                   **self.scorer.counted_metrics(),
                   **episode_metrics([e for g in collected.groups for e in g.episodes or ()])}
        metrics["rollout/engines_alive"] = float(self.engines.num_engines_alive())
        metrics["rollout/engine_restarts"] = float(self.engines.engine_restarts)
        if outcome.teacher is not None:
            metrics["distillation/teacher_seconds"] = outcome.teacher.seconds
        metrics.update({"timing/step_s": seconds, "timing/tokens_per_s": metrics["timing/generated_tokens"] / seconds,
                        "train/epoch": float(self.stream.epoch)})
        self.metric_logger.log(metrics, step)
        self._log_completions(collected.groups, step)
        return metrics

    def _log_completions(self, groups: list, step: int) -> None:
        """Up to `trainer.log_completions` prompt / completion / reward rows of this step, to completions.jsonl."""
        if self.completion_rows <= 0:
            return
        table = []
        for group in groups:
            for text, score, acc in zip(group.response_texts, group.scores.tolist(), group.acc.tolist()):
                table.append({"prompt": group.record.messages[-1]["content"], "completion": text, "score": score,
                              "acc": acc})
        self.metric_logger.log_table("completions", table[:self.completion_rows], step)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.metric_logger.log(metrics, step)

    def log_end(self, step: int, early_stopped: bool) -> None:
        if early_stopped:
            logger.warning("%s", self.early_stop_reason(step))
        else:
            logger.info("the run has generated its %d samples (trainer.total_rollout_samples) after step %d",
                        self.samples.total, step)

    def close(self) -> None:
        if self.metric_logger is not None:
            self.metric_logger.close()
        self.scorer.close()
        if self.teachers is not None:  # a teacher's engines joined the rollout's Ray: they stop first
            self.teachers.shutdown()
        if isinstance(self.sampler, EpisodeRunner):
            self.sampler.close()
        if self.owns_engines:
            self.engines.shutdown()
        else:
            self.engines.cancel_all()


def announce_engines(rollout: RolloutConfig, model_path: str, given: bool) -> None:
    """Say what the slow part of start-up is doing (data, engines) before it happens."""
    if given:
        logger.info("loading data; using the rollout engines passed in")
    elif rollout.mode == "server":
        logger.info("loading data; connecting to the rollout servers %s", ", ".join(rollout.server_urls))
    else:
        where = "colocated on the trainer's devices" if rollout.mode == "colocate" else "as Ray actors"
        logger.info("loading data and starting vLLM engine(s) %s for %s (tens of seconds)", where, model_path)


def make_generator(multi_turn: MultiTurnConfig, sandbox: SandboxConfig, engines: RolloutEngines, tokenizer: Any,
                   data: DataConfig) -> GroupGenerator:
    """The run's group generator: episodes of each row's environment with `rollout.multi_turn.enable` (tools run in
    `reward.sandbox`; episodes fit `data.*`'s lengths), else one sampled answer per sample."""
    if not multi_turn.enable:
        return SingleTurnGenerator(engines)
    return EpisodeRunner(engines, tokenizer, EnvironmentRegistry(multi_turn, sandbox), data.max_response_length,
                         data.max_prompt_length, data.truncation)


def self_teacher_hints(distillation: DistillationConfig, data: DataConfig, tokenizer: Any
                       ) -> HintContextBuilder | None:
    """The hint contexts of distillation's `self` teacher (the policy given the gold solution): every response's
    prompt with its gold solution (`data.hint_key`), through the chat template; None without a self teacher."""
    if not distillation.has_self_teacher:
        return None
    return HintContextBuilder(CPOConfig(gold_as_hint=True), data, tokenizer,
                              lambda correct, group: torch.ones_like(correct))


def batch_reward_metrics(groups: list) -> dict[str, float]:
    """ms-swift's reward, reward_std (mean in-group std), frac_reward_zero_std, and acc over the trained batch."""
    scores = torch.stack([g.scores.float() for g in groups])
    acc = torch.stack([g.acc.float() for g in groups])
    group_std = scores.std(dim=1, unbiased=False)
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std(unbiased=False)),
            "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "reward_std": float(group_std.mean()), "frac_reward_zero_std": float((group_std == 0).float().mean()),
            "reward/acc": float(acc.mean())}
