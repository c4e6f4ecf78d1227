"""Steps 3-5 of docs/architecture.md's "One RL step", as every rank runs them in lockstep on the broadcast batch.

Each returns a new frozen value no later step changes: `compute_log_probs` -> `BatchLogProbs`, `compute_advantages`
-> `StepAdvantages` (with the step's `ResponseShaping`, shaping.py), `update_critic`, `update_policy` ->
`PolicyUpdate`. A `FiniteProbe` (update_guard.py) records where a first non-finite value appeared.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from operator import itemgetter

import torch

from megatron_cpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megatron_cpo.algorithms.config import AlgorithmConfig, RolloutCorrectionConfig
from megatron_cpo.algorithms.distillation_config import DistillationLossConfig
from megatron_cpo.algorithms.kl import kl_in_reward, kl_penalty
from megatron_cpo.algorithms.masked import masked_mean
from megatron_cpo.algorithms.mismatch import mismatch_by_staleness
from megatron_cpo.algorithms.value_loss import value_metrics
from megatron_cpo.rewards.manager import token_level_rewards
from megatron_cpo.rollout.teacher_config import DistillationConfig
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.batch.sequences import PackedSequences, pack_sequences
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.critic_config import CriticConfig
from megatron_cpo.trainer.workers.actor import MegatronPolicy, UpdateInputs
from megatron_cpo.trainer.workers.critic import MegatronCritic
from megatron_cpo.trainer.workers.distillation_step import TeacherSignal, TrainerTeacher, teacher_signal
from megatron_cpo.trainer.workers.routing import RecordedRouting
from megatron_cpo.trainer.workers.shaping import ResponseShaping, ScoredTokens, ShapedAdvantages, ShapingSources
from megatron_cpo.trainer.workers.update_guard import FiniteProbe


@dataclass
class PolicyUpdateConfig:
    """What steps 3-5 read: `actor_rollout_ref.actor` and `algorithm` as they are, and from the other sections the
    response width (`data.max_response_length`), the scoring temperature (`rollout.log_prob_temperature`), the
    responses per prompt (`rollout.n`), the batch's prompts (`data.train_batch_size`) and the staleness bound
    (`async_training.max_staleness`); with a critic, its section and `trainer.critic_warmup`. The trainer builds it
    once (`trainer/loop.py`)."""
    actor: ActorConfig
    algorithm: AlgorithmConfig
    response_width: int
    temperature: float = 1.0
    samples_per_prompt: int = 1
    train_batch_size: int = 1
    max_staleness: int = 0
    critic: CriticConfig | None = None
    critic_warmup: int = 0
    distillation: DistillationConfig | None = None  # `distillation` when enabled (docs/distillation.md)

    @property
    def distillation_loss(self) -> DistillationLossConfig | None:
        """verl's distillation term of the actor's loss (None: no distillation, or slime's additive form)."""
        distillation = self.distillation
        if distillation is None or distillation.uses_additive_form:
            return None
        return distillation.distillation_loss

    @property
    def correction(self) -> RolloutCorrectionConfig | None:
        """`algorithm.rollout_correction` as this run applies it (`auto` resolved against the staleness bound and the
        actor's TIS); None: no correction."""
        return self.algorithm.rollout_correction.resolve(self.max_staleness, tis_on=self.actor.tis is not None)

    @property
    def responses_per_mini_batch(self) -> int:
        return self.actor.ppo_mini_batch_size * self.samples_per_prompt


def prepare_sequences(batch: StepBatch, pad_token_id: int, width: int) -> tuple[PackedSequences, RaggedRows]:
    """The batch's prompt + response sequences (with the episodes' loss mask, when any) and the engine's log-probs
    (ragged: each mini-batch pads its own rows to [rows, width] when it trains)."""
    return (pack_sequences(batch.prompt_ids, batch.response_ids, pad_token_id, width, batch.loss_mask),
            batch.rollout_log_probs)


def token_rewards_of(batch: StepBatch, lp: BatchLogProbs, algo: AlgorithmConfig
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """Each response's score on its last sampled token, [N, R], minus verl's KL penalty per token (`coef` x the
    `algorithm.kl_penalty` estimate of KL(actor || reference)) when `algorithm.use_kl_in_reward`."""
    mask = lp.mask
    positions = torch.arange(mask.shape[1])
    last_sampled = torch.where(mask.bool(), positions, -1).max(-1).values + 1  # an empty row: position 0
    rewards = token_level_rewards(batch.scores.float(), last_sampled.clamp(min=1), mask.shape[1])
    if not algo.use_kl_in_reward:
        return rewards, {}
    rewards, metrics = kl_in_reward(rewards, lp.old_log_probs, lp.ref_log_probs, mask, algo.kl_penalty,
                                    algo.kl_ctrl.kl_coef)
    return rewards, {**metrics, "reward/with_kl_mean": float(rewards.sum(-1).mean())}


def _masked_stats(prefix: str, per_response: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": float(per_response.mean()), f"{prefix}/max": float(per_response.max()),
            f"{prefix}/min": float(per_response.min())}


@dataclass(frozen=True)
class BatchLogProbs:
    """Step 3's results: the batch's sequences and every rank's log-probs of the responses under each model.

    `old_log_probs` and `entropy` are None when the update computes them from its own forward
    (`old_log_probs_from_update`); its `PolicyUpdate` holds them then."""
    seqs: PackedSequences
    mask: torch.Tensor
    rollout_log_probs: RaggedRows  # the engine's, padded per mini-batch when it trains
    old_log_probs: torch.Tensor | None
    entropy: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    hint_log_probs: torch.Tensor | None  # CPO: [N, R], the responses `batch.has_hint` marks under their hinted
    # prompts (0 on the other rows; None: none was scored)
    routing: RecordedRouting | None = None  # MoE: the old pass's routing, for the update to replay or compare
    routing_metrics: dict[str, float] = field(default_factory=dict)  # MoE: expert load, router entropy
    timing: dict[str, float] = field(default_factory=dict)  # seconds of each scoring pass (timing/*_s)
    values: torch.Tensor | None = None  # a critic's value of every response token (GAE)
    teacher: TeacherSignal | None = None  # distillation: the teacher's scores of the responses


def old_log_probs_from_update(settings: PolicyUpdateConfig) -> bool:
    """Whether the PPO ratio's old log-probs can be the update's own forward, detached, instead of a separate scoring
    pass (as verl): one epoch over one mini-batch, and nothing reads, records or skips in that pass (verl's
    KL-in-reward, routing replay R2, a critic's warm-up). docs/trainer.md explains "old" here.
    """
    actor, algorithm = settings.actor, settings.algorithm
    one_update = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= settings.train_batch_size
    return (one_update and not algorithm.use_kl_in_reward and not actor.router_replay.replays
            and settings.critic_warmup == 0)


def compute_log_probs(batch: StepBatch, actor: MegatronPolicy, reference: MegatronPolicy | None,
                      settings: PolicyUpdateConfig, pad_token_id: int, critic: MegatronCritic | None = None,
                      probe: FiniteProbe | None = None, teacher: TrainerTeacher | None = None) -> BatchLogProbs:
    """Old log-probs and entropy under the actor (with a mixture of experts' routing), the reference's log-probs,
    the hinted ones for CPO, a critic's values and distillation's teacher signal (the engine teachers' from the
    batch, or `teacher`'s pass); `probe` observes them. The old pass is left to the update when
    `old_log_probs_from_update` holds and the actor tracks no routing (a mixture of experts records it in this
    pass)."""
    temperature, width = settings.temperature, settings.response_width
    seqs, rollout_log_probs = prepare_sequences(batch, pad_token_id, width)
    timing: dict[str, float] = {}
    old_log_probs = entropy = routing = ref_log_probs = hint_log_probs = values = None
    routing_metrics: dict[str, float] = {}
    if actor.routing is not None or not old_log_probs_from_update(settings):
        start = time.perf_counter()
        old_log_probs, entropy, routing, routing_metrics = actor.log_probs_and_routing(seqs, temperature)
        timing["timing/old_log_prob_s"] = time.perf_counter() - start
    if reference is not None:
        start = time.perf_counter()
        ref_log_probs = reference.log_probs(seqs, temperature)[0]
        timing["timing/ref_s"] = time.perf_counter() - start
    if batch.hint_prompt_ids is not None and settings.algorithm.shaper.needs_hint_contexts:
        # only the responses whose advantages the hint can change
        start = time.perf_counter()
        rows = batch.has_hint.nonzero()[:, 0]
        hint_seqs = pack_sequences(batch.hint_prompt_ids, batch.response_ids.select(rows), pad_token_id, width)
        hint_log_probs = torch.zeros(batch.response_ids.rows, width)
        hint_log_probs[rows] = actor.log_probs(hint_seqs, temperature)[0]
        timing["timing/hint_log_prob_s"] = time.perf_counter() - start
    if critic is not None:
        start = time.perf_counter()
        values = critic.values(seqs)
        timing["timing/values_s"] = time.perf_counter() - start
    signal = None
    if settings.distillation is not None:
        start = time.perf_counter()
        signal = teacher_signal(batch, seqs, teacher, pad_token_id)
        if teacher is not None:
            timing["timing/teacher_log_prob_s"] = time.perf_counter() - start
    mask = seqs.response_mask()
    probe = probe if probe is not None else FiniteProbe()
    for log_probs in (old_log_probs, ref_log_probs, hint_log_probs):
        probe.observe("log-probs", log_probs, mask)
    if signal is not None:
        probe.observe("log-probs", signal.log_probs, mask * signal.rows[:, None])
    probe.observe("values", values, mask)
    return BatchLogProbs(seqs, mask, rollout_log_probs, old_log_probs, entropy, ref_log_probs, hint_log_probs,
                         routing, routing_metrics, timing, values, signal)


@dataclass(frozen=True)
class StepAdvantages:
    """Step 4's result: the estimator's advantages (`estimated`), GAE's returns (the critic's targets; None without a
    critic), the step's `shaping`, and what it made of them when it ran before the update (`shaped`; its
    `advantages` are the ones to train on). `shaped` is None when the update shapes each micro-batch from its own
    forward (on-policy, with a term that reads the log-probs): its `PolicyUpdate` holds them then."""
    estimated: torch.Tensor
    returns: torch.Tensor | None
    shaping: ResponseShaping
    shaped: ShapedAdvantages | None


def compute_advantages(batch: StepBatch, lp: BatchLogProbs, settings: PolicyUpdateConfig,
                       probe: FiniteProbe | None = None) -> tuple[StepAdvantages, dict[str, float]]:
    """The advantages of `algorithm.adv_estimator` (advantages.py; token rewards with verl's KL-in-reward penalty
    when on) and, unless the update shapes them from the log-probs it computes itself, the step's shaping of them
    (shaping.py: the shaper's rule such as CPO's, the filters' loss scale) with its metrics; `probe` observes the
    rewards and advantages."""
    algo, mask = settings.algorithm, lp.mask
    probe = probe if probe is not None else FiniteProbe()
    token_rewards, metrics = token_rewards_of(batch, lp, algo)
    inputs = AdvantageInputs(token_rewards, mask, batch.group, gamma=algo.gamma, lam=algo.lam,
                             norm_by_std=algo.norm_adv_by_std_in_grpo, values=lp.values,
                             reward_baselines=batch.reward_baselines)
    estimated, returns = ADVANTAGE_ESTIMATORS[algo.estimator_name](inputs)
    returns = returns if lp.values is not None else None  # the critic's targets (GAE)
    if batch.reward_baselines is not None:
        metrics["reward/greedy_baseline_mean"] = float(batch.reward_baselines.mean())
    if algo.shaper.needs_hint_contexts:
        metrics.update({"cpo/hints_truncated": float(batch.hints_truncated), **(batch.hint_metrics or {})})
    probe.observe("rewards", token_rewards, mask)
    probe.observe("advantages", estimated, mask)
    shaping = ResponseShaping.of_step(ShapingSources(batch, lp.hint_log_probs, algo, settings.actor, lp.teacher,
                                                     settings.distillation))
    if shaping.reads_log_probs and lp.old_log_probs is None:  # the update shapes (and probes) them
        return StepAdvantages(estimated, returns, shaping, None), metrics
    tokens = ScoredTokens(mask, lp.old_log_probs, lp.entropy)
    shaped = shaping.shape(estimated, tokens)
    metrics.update(shaping.metrics(shaped, tokens))
    probe.observe("advantages", shaped.advantages, mask)
    return StepAdvantages(estimated, returns, shaping, shaped), metrics


def _mini_batches(rows: int, rows_per_mini: int, epochs: int) -> list[slice]:
    """The rows of each optimizer step: `epochs` passes over consecutive mini-batches of `rows_per_mini`."""
    return [slice(begin, begin + rows_per_mini) for _ in range(epochs) for begin in range(0, rows, rows_per_mini)]


def _mean_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    return {key: sum(m[key] for m in per_update) / len(per_update) for key in (per_update[0] if per_update else ())}


def update_critic(critic: MegatronCritic, lp: BatchLogProbs, advantages: StepAdvantages,
                  settings: PolicyUpdateConfig, probe: FiniteProbe | None = None) -> dict[str, float]:
    """The critic's epochs over mini-batches (`critic.ppo_epochs`, `critic.ppo_mini_batch_size` prompts; one
    optimizer step each) towards GAE's returns, clipped around the values of step 3; verl's critic metrics."""
    config = settings.critic
    start = time.perf_counter()
    metrics = _mean_metrics([
        critic.update(lp.seqs.select(rows), lp.values[rows], advantages.returns[rows], probe)
        for rows in _mini_batches(lp.seqs.rows, config.ppo_mini_batch_size * settings.samples_per_prompt,
                                  config.ppo_epochs)])
    metrics.update(value_metrics(lp.values, advantages.returns, lp.mask))
    metrics["timing/update_critic_s"] = time.perf_counter() - start
    return metrics


@dataclass(frozen=True)
class PolicyUpdate:
    """Step 5's result: the update's metrics (with the batch's length, advantage, entropy and KL statistics), and what
    it trained on: the old log-probs and entropy (step 3's, or the update's own forward's) and the advantages."""
    metrics: dict[str, float]
    old_log_probs: torch.Tensor
    entropy: torch.Tensor
    advantages: torch.Tensor


def _on_policy_update(actor: MegatronPolicy, lp: BatchLogProbs, advantages: StepAdvantages,
                      settings: PolicyUpdateConfig, probe: FiniteProbe | None
                      ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor, ShapedAdvantages]:
    """The one optimizer step of `old_log_probs_from_update`, shaping each micro-batch from its forward when step 4
    left the shaping to it: its metrics, that forward's log-probs and entropy, and the shaped advantages."""
    shaping = advantages.shaping if advantages.shaped is None else None
    given = advantages.estimated if shaping is not None else advantages.shaped.advantages
    engine_log_probs = lp.rollout_log_probs.select(torch.arange(lp.seqs.rows)).padded(settings.response_width, 0.0)
    inputs = UpdateInputs(given, None, lp.ref_log_probs, engine_log_probs, settings.correction, shaping=shaping,
                          probe=probe, teacher=lp.teacher, distillation=settings.distillation_loss)
    result = actor.update_on_policy(lp.seqs, inputs, settings.temperature)
    shaped = result.shaped if result.shaped is not None else advantages.shaped
    return result.metrics, result.log_probs, result.entropy, shaped


def _mini_batch_updates(actor: MegatronPolicy, lp: BatchLogProbs, advantages: torch.Tensor,
                        settings: PolicyUpdateConfig, probe: FiniteProbe | None) -> list[dict[str, float]]:
    """The PPO epochs over mini-batches, one optimizer step each, on step 3's old log-probs: each one's metrics."""
    per_update, width = [], settings.response_width
    for rows in _mini_batches(lp.seqs.rows, settings.responses_per_mini_batch, settings.actor.ppo_epochs):
        engine_log_probs = lp.rollout_log_probs.select(torch.arange(lp.seqs.rows)[rows]).padded(width, 0.0)
        inputs = UpdateInputs(advantages[rows], lp.old_log_probs[rows],
                              lp.ref_log_probs[rows] if lp.ref_log_probs is not None else None,
                              engine_log_probs, settings.correction, lp.routing, rows.start, probe=probe,
                              teacher=lp.teacher.map_rows(itemgetter(rows)) if lp.teacher is not None else None,
                              distillation=settings.distillation_loss)
        per_update.append(actor.update(lp.seqs.select(rows), inputs, settings.temperature))
    return per_update


def update_policy(actor: MegatronPolicy, batch: StepBatch, lp: BatchLogProbs, advantages: StepAdvantages,
                  settings: PolicyUpdateConfig, probe: FiniteProbe | None = None, train: bool = True
                  ) -> PolicyUpdate:
    """The PPO epochs over mini-batches (one optimizer step each), and the batch's length / advantage / KL stats. When
    the update shaped the advantages itself, the shaping's metrics are those of what it trained on.
    `train=False` (a critic's warm-up step, `trainer.critic_warmup`) leaves the actor as it is and logs the stats
    only."""
    start = time.perf_counter()
    if lp.old_log_probs is None:  # old_log_probs_from_update: one mini-batch, one epoch
        metrics, old_log_probs, entropy, shaped = _on_policy_update(actor, lp, advantages, settings, probe)
        per_update = [metrics]
    else:
        old_log_probs, entropy, shaped = lp.old_log_probs, lp.entropy, advantages.shaped
        per_update = _mini_batch_updates(actor, lp, shaped.advantages, settings, probe) if train else []
    metrics = _mean_metrics(per_update)
    metrics.update({**lp.routing_metrics, **lp.timing})
    if train:
        metrics["timing/update_actor_s"] = time.perf_counter() - start
    mask, trained = lp.mask, shaped.advantages
    if advantages.shaped is None:  # shaped inside the update: the metrics of what it trained on
        metrics.update(advantages.shaping.metrics(shaped, ScoredTokens(mask, old_log_probs, entropy)))
    lengths = lp.seqs.response_lengths.float()
    metrics.update(_masked_stats("entropy", masked_mean(entropy, mask, -1)))
    metrics.update({
        "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(batch.truncated.float().mean()),
        "advantages/mean": float(masked_mean(trained, mask)),
        "advantages/abs_mean": float(masked_mean(trained.abs(), mask)),
        "timing/train_tokens": float(mask.sum()),
    })
    if lp.ref_log_probs is not None:
        kl = kl_penalty(old_log_probs, lp.ref_log_probs, settings.actor.kl_loss_type)
        metrics["kl"] = float(masked_mean(kl, mask))
    metrics.update(staleness_mismatch(batch, lp, old_log_probs, settings))
    return PolicyUpdate(metrics, old_log_probs, entropy, trained)


def staleness_mismatch(batch: StepBatch, lp: BatchLogProbs, old_log_probs: torch.Tensor,
                       settings: PolicyUpdateConfig) -> dict[str, float]:
    """With asynchronous training: the engine-vs-trainer log-prob mismatch of the batch's tokens (`old_log_probs`,
    the trainer's), split by how many weight versions each token is behind the trainer (staleness 0: the engine's
    difference alone)."""
    if settings.max_staleness == 0 or batch.policy_versions is None or batch.policy_version is None:
        return {}
    width = settings.response_width
    staleness = batch.policy_version - batch.policy_versions.padded(width, batch.policy_version)
    return mismatch_by_staleness(old_log_probs, lp.rollout_log_probs.padded(width, 0.0), lp.mask, staleness)
