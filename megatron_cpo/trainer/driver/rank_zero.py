"""What only rank 0 does in a run: data, engines, the controller, grading, validation, run controls and logging.

The other ranks learn its decisions through `collectives.py`. Engines passed in (already running, e.g. shared by
tests or a notebook) are used and left running; given the run's `EngineLaunchConfig` instead, the engines are
started here. `RankZero` is rank 0's composition root: the one class of the driver that reads the whole
`Config`, and hands each component its own section.
"""
from __future__ import annotations

import logging
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch

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
from megatron_cpo.rollout.generators import GreedyBaselineGenerator, GroupGenerator, SingleTurnGenerator
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.modes import build_rollout_manager
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEnginesLostError
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.driver.accumulator import group_selection
from megatron_cpo.trainer.driver.admission import admission_for
from megatron_cpo.trainer.driver.batching import make_step_batch
from megatron_cpo.trainer.driver.controller import CollectedBatch, RolloutController, prompt_limit
from megatron_cpo.trainer.driver.grading import ResponseScorer
from megatron_cpo.trainer.driver.loggers import MetricLogger
from megatron_cpo.trainer.driver.prompt_stream import PromptStream
from megatron_cpo.trainer.driver.rollout_side import HintContextBuilder, training_sampling_params
from megatron_cpo.trainer.driver.sample_budget import SampleBudget
from megatron_cpo.trainer.driver.validation import Validator

logger = logging.getLogger(__name__)


class RankZero:
    """Rank 0's side of a run (step numbers of docs/architecture.md, "One RL step"): `collect` fills a batch (1),
    `make_batch` flattens it for the broadcast (2), `observe_early_stop` feeds the monitor (8), `validate` (9) and
    `log_step` writes the step's metrics (10); `open_log` starts the metric sinks once the resume step is known."""

    def __init__(self, config: Config, tokenizer: Any, engines: RolloutEngines | EngineLaunchConfig) -> None:
        self.config = config
        data, rollout, algorithm, trainer = (config.data, config.actor_rollout_ref.rollout, config.algorithm,
                                             config.trainer)
        needs_ground_truth = config.reward.needs_ground_truth
        self.train_data = PromptDataset(data.train_files, tokenizer, data, needs_ground_truth=needs_ground_truth)
        val_data = (PromptDataset(data.val_files, tokenizer, data, needs_ground_truth=needs_ground_truth)
                    if data.val_files else None)
        self.stream = PromptStream(self.train_data, trainer.total_epochs, trainer.seed, data.shuffle)
        self.owns_manager = isinstance(engines, EngineLaunchConfig)
        # rollout.mode: ray, server or colocate
        self.manager = build_rollout_manager(rollout, engines) if self.owns_manager else engines
        self.sampler = make_generator(rollout.multi_turn, config.reward.sandbox, self.manager, tokenizer, data)
        # ReMax: each prompt's greedy answer too, as its baseline (validation samples without it)
        self.generator = (GreedyBaselineGenerator(self.sampler) if algorithm.estimator_needs.greedy_baseline
                          else self.sampler)
        self.scorer = ResponseScorer(config.reward, tokenizer)
        eos = tokenizer.eos_token_id
        shaper = algorithm.shaper
        self.hints = (HintContextBuilder(algorithm.cpo, data, tokenizer, shaper.hinted_responses)
                      if shaper.needs_hint_contexts else None)
        selection = group_selection(algorithm.filter_groups, rollout, config.reward.overlong_buffer,
                                    data.train_batch_size, data.max_response_length)
        self.controller = RolloutController(
            self.generator, self.stream, self.scorer.score_groups,
            admission_for(config.async_training, data.train_batch_size, rollout.max_inflight_prompts), selection,
            lambda seed: training_sampling_params(rollout, data.max_response_length, eos, seed), data,
            algorithm.filter_groups, prompt_limit(algorithm.filter_groups, rollout, data.generation_batch_size))
        # with asynchronous training, validation shares the engines with training requests in flight
        self.validator = Validator(val_data, self.sampler, self.scorer,
                                   training_sampling_params(rollout, data.max_response_length, eos, None, greedy=True),
                                   rollout.val_kwargs, trainer.seed, data.val_max_samples, self.controller.receive)
        self.monitor = EarlyStopMonitor(trainer.early_stop) if trainer.early_stop.enable else None
        self.samples = SampleBudget(trainer.total_rollout_samples, trainer.test_freq_samples)
        self.metric_logger: MetricLogger | None = None

    def open_log(self, total_steps: int, resume_step: int) -> None:
        trainer = self.config.trainer
        self.metric_logger = MetricLogger(trainer.logger, Path(trainer.default_local_dir), total_steps,
                                          trainer.project_name, trainer.experiment_name, config_to_dict(self.config),
                                          trainer.log_verl_metric_names,
                                          self.config.actor_rollout_ref.rollout.val_kwargs.n, resume_step=resume_step)

    # --- steps 1-2: collect, flatten for the broadcast --------------------------------------------------------
    def collect(self, step: int) -> tuple[CollectedBatch | None, str | None]:
        """This step's kept groups, or (None, why) when no engine is left; then, and when a non-finite reward stops
        the run (`NonFiniteRewardError`, raised), the data position goes back to the first prompt not yet trained,
        so a resumed run (or this step collected again once restarted engines took the weights) collects the same
        prompts: what was outstanding is dropped."""
        position = self.controller.state_dict()
        try:
            return self.controller.collect(step, self.manager.weight_version), None
        except RolloutEnginesLostError as err:
            self.generator.cancel_all()
            self.controller.load_state_dict(position)
            return None, str(err)
        except NonFiniteRewardError:
            self.controller.load_state_dict(position)
            raise

    def generation_held(self) -> AbstractContextManager[None]:
        """What the weight push runs inside: episodes advance on their own thread (envs/runner.py) and submit no
        turn meanwhile; single answers are submitted by the controller alone, so there is nothing to hold."""
        return self.generator.held() if isinstance(self.generator, EpisodeRunner) else nullcontext()

    def make_batch(self, collected: CollectedBatch | None) -> StepBatch | None:
        """The kept groups as a `StepBatch` (with CPO's hint contexts), or None when there is nothing to train on."""
        if collected is None or not collected.groups or not collected.trainable:
            return None
        return make_step_batch(collected.groups, collected.metrics["filter/kept_ratio"], self.hints,
                               collected.policy_version)

    def count_samples(self, collected: CollectedBatch, metrics: dict[str, float]) -> tuple[bool, bool]:
        """Add the step's generated samples to the run's count (`train/generated_samples` in `metrics`); (whether
        that makes a validation due by `trainer.test_freq_samples`, whether the budget is spent)."""
        due = self.samples.add(int(collected.metrics["rollout/generated_samples"]))
        metrics["train/generated_samples"] = float(self.samples.generated)
        return due, self.samples.spent

    # --- step 8: early stop -----------------------------------------------------------------------------------
    def observe_early_stop(self, collected: CollectedBatch) -> tuple[bool, dict[str, float]]:
        """Feed the reward-variance monitor; (stop now?, its metrics)."""
        stopped = self.monitor.observe(collected.metrics["rollout/in_group_reward_std"], successful=True)
        baseline = self.monitor.baseline
        return stopped, {"train/early_stopped": float(stopped),
                         "early_stop/baseline": baseline if baseline is not None else 0.0}

    def early_stop_reason(self, step: int) -> str:
        cfg = self.monitor.config
        return (f"early stop after step {step}: the last {cfg.window} values of rollout/in_group_reward_std were "
                f"all below {cfg.ratio} x the baseline {self.monitor.baseline:.4g} (mean of the first "
                f"{cfg.baseline_steps} steps); the rewards no longer separate the responses of a prompt. A checkpoint "
                "was written; to train on, resume with trainer.early_stop.enable=false")

    # --- steps 9-10: validation, metrics ----------------------------------------------------------------------
    def validate(self) -> dict[str, float]:
        """Validation metrics; {} (with a warning) when the engines were lost meanwhile, so the step's checkpoint
        is still written and the next rollout ends the run with the full message."""
        try:
            return self.validator.validate()
        except RolloutEnginesLostError as err:
            logger.warning("validation skipped: %s", err)
            return {}

    def log_step(self, step: int, metrics: dict[str, float], collected: CollectedBatch, seconds: float
                 ) -> dict[str, float]:
        """Add rank 0's metrics (rollout, rewards, timing) to the step's and write its row."""
        metrics = {**metrics, **collected.metrics, **batch_reward_metrics(collected.groups),
                   **self.scorer.counted_metrics(),
                   **episode_metrics([e for g in collected.groups for e in g.episodes or ()])}
        metrics["rollout/engines_alive"] = float(self.manager.num_engines_alive())
        metrics["rollout/engine_restarts"] = float(self.manager.engine_restarts)
        metrics.update({"timing/step_s": seconds, "timing/tokens_per_s": metrics["timing/generated_tokens"] / seconds,
                        "train/epoch": float(self.stream.epoch)})
        self.metric_logger.log(metrics, step)
        self._log_completions(collected.groups, step)
        return metrics

    def _log_completions(self, groups: list, step: int) -> None:
        """Up to `trainer.log_completions` prompt / completion / reward rows of this step, to completions.jsonl."""
        rows = self.config.trainer.log_completions
        if rows <= 0:
            return
        table = []
        for group in groups:
            for text, score, acc in zip(group.response_texts, group.scores.tolist(), group.acc.tolist()):
                table.append({"prompt": group.record.messages[-1]["content"], "completion": text, "score": score,
                              "acc": acc})
        self.metric_logger.log_table("completions", table[:rows], step)

    def engines(self) -> tuple[int, int]:
        return self.manager.num_engines_alive(), len(self.manager.engines)

    def close(self) -> None:
        if self.metric_logger is not None:
            self.metric_logger.close()
        self.scorer.close()
        if isinstance(self.sampler, EpisodeRunner):
            self.sampler.close()
        if self.owns_manager:
            self.manager.shutdown()
        else:
            self.manager.cancel_all()


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


def batch_reward_metrics(groups: list) -> dict[str, float]:
    """ms-swift's reward, reward_std (mean in-group std), frac_reward_zero_std, and acc over the trained batch."""
    scores = torch.stack([g.scores.float() for g in groups])
    acc = torch.stack([g.acc.float() for g in groups])
    group_std = scores.std(dim=1, unbiased=False)
    return {"reward/mean": float(scores.mean()), "reward/std": float(scores.std(unbiased=False)),
            "reward/max": float(scores.max()), "reward/min": float(scores.min()),
            "reward_std": float(group_std.mean()), "frac_reward_zero_std": float((group_std == 0).float().mean()),
            "reward/acc": float(acc.mean())}
