"""One training update on a collected batch, as every rank runs it (steps 4-6 of ARCHITECTURE.md).

Rank 0 turns the kept groups into a `StepBatch` (flat token / log-prob tensors with offsets, hint contexts included)
and broadcasts it tensor by tensor; then every rank computes, in lockstep: old log-probs and entropy, reference
log-probs, hint log-probs (CPO), GRPO advantages, the CPO shaping rule, filter loss scaling, and the PPO epochs over
mini-batches. With verl's `algorithm.use_kl_in_reward` the scores the advantages see carry the KL penalty against the
reference.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.algorithms.advantages import grpo_advantages
from megatron_cpo.algorithms.cpo import difficulty_mask, shape_advantages
from megatron_cpo.algorithms.filters import filter_loss_scale, scale_advantages
from megatron_cpo.algorithms.kl import kl_in_reward, kl_penalty
from megatron_cpo.algorithms.losses import PolicyLossConfig
from megatron_cpo.algorithms.masked import masked_mean
from megatron_cpo.algorithms.mismatch import TISConfig
from megatron_cpo.config import Config
from megatron_cpo.kernels import hint_mi_signals
from megatron_cpo.rewards.manager import token_level_rewards
from megatron_cpo.trainer.accumulator import ScoredGroup
from megatron_cpo.trainer.actor import MegatronPolicy, UpdateInputs
from megatron_cpo.trainer.ragged import RaggedRows
from megatron_cpo.trainer.sequences import PackedSequences, pack_sequences


@dataclass
class StepBatch:
    """Everything the ranks need for one update; one row per response, responses of a prompt contiguous.

    Token and log-prob rows are `RaggedRows` (one flat tensor + offsets each; Python lists are converted when the batch
    is built), so the broadcast sends a few buffers instead of pickling every token.
    """
    prompt_ids: RaggedRows
    response_ids: RaggedRows
    rollout_log_probs: RaggedRows
    scores: torch.Tensor
    acc: torch.Tensor
    group: torch.Tensor
    truncated: torch.Tensor
    kept_ratio: float  # the group filters' kept / judged groups (filter_loss_scaling scales by it)
    hint_prompt_ids: RaggedRows | None = None
    has_hint: torch.Tensor | None = None
    hints_truncated: int = 0
    hint_metrics: dict[str, float] | None = None  # cpo/hint_source/<key> counts (data.hint_key)

    def __post_init__(self) -> None:
        self.prompt_ids = RaggedRows.of(self.prompt_ids)
        self.response_ids = RaggedRows.of(self.response_ids)
        self.rollout_log_probs = RaggedRows.of(self.rollout_log_probs, torch.float32)
        if self.hint_prompt_ids is not None:
            self.hint_prompt_ids = RaggedRows.of(self.hint_prompt_ids)


def make_step_batch(groups: list[ScoredGroup], kept_ratio: float, hint_builder: Any = None) -> StepBatch:
    """Flatten kept groups into a `StepBatch`; `hint_builder(groups, prompts, responses)` adds CPO hint contexts."""
    hints = {}
    if hint_builder is not None:
        prompts = [g.prompt_token_ids for g in groups for _ in range(g.n)]
        responses = [r for g in groups for r in g.response_token_ids]
        contexts = hint_builder(groups, prompts, responses)
        hints = {"hint_prompt_ids": contexts.prompt_ids, "has_hint": contexts.has_hint,
                 "hints_truncated": contexts.num_truncated, "hint_metrics": contexts.source_metrics}
    group = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([g.n for g in groups]))
    return StepBatch(
        prompt_ids=RaggedRows.from_lists([g.prompt_token_ids for g in groups]).repeat_rows([g.n for g in groups]),
        response_ids=RaggedRows.cat([g.ragged()[0] for g in groups]),
        rollout_log_probs=RaggedRows.cat([g.ragged()[1] for g in groups]),
        scores=torch.cat([g.scores.float() for g in groups]), acc=torch.cat([g.acc.float() for g in groups]),
        group=group, truncated=torch.cat([g.truncated for g in groups]), kept_ratio=kept_ratio, **hints)


def _batch_tensors(batch: StepBatch) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The batch as named tensors (ragged rows as `<field>.values` / `<field>.offsets`) and its other fields."""
    tensors, other = {}, {}
    for item in fields(batch):
        value = getattr(batch, item.name)
        if isinstance(value, RaggedRows):
            tensors[f"{item.name}.values"], tensors[f"{item.name}.offsets"] = value.values, value.offsets
        elif isinstance(value, torch.Tensor):
            tensors[item.name] = value
        else:
            other[item.name] = value
    return tensors, other


def _wire_dtype(tensor: torch.Tensor) -> torch.dtype:
    """int32 for int64 values that fit in it (token ids), else the tensor's own dtype."""
    if tensor.dtype == torch.long and tensor.numel() and int(tensor.abs().max()) < 2**31:
        return torch.int32
    return tensor.dtype


def broadcast_batch(batch: StepBatch | None) -> StepBatch | None:
    """Rank 0's batch (or None: stop) on every rank: a small header (shapes, dtypes, scalars), then one broadcast per
    tensor, on the device the backend needs; token ids travel as int32 when they fit (half the bytes)."""
    if dist.get_world_size() == 1:
        return batch
    header: list[Any] = [None]
    tensors: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0 and batch is not None:
        tensors, other = _batch_tensors(batch)
        header = [({name: (tuple(t.shape), t.dtype, _wire_dtype(t)) for name, t in tensors.items()}, other)]
    dist.broadcast_object_list(header, src=0)
    if header[0] is None:
        return None
    specs, other = header[0]
    received = {}
    for name, (shape, dtype, wire_dtype) in specs.items():
        wire = tensors[name].to(wire_dtype) if name in tensors else torch.empty(shape, dtype=wire_dtype)
        wire = wire.contiguous().to(platform.device())
        dist.broadcast(wire.view(torch.uint8) if dtype == torch.bool else wire, src=0)
        received[name] = wire.cpu().to(dtype)
    kwargs = dict(other)
    for item in fields(StepBatch):
        if f"{item.name}.values" in received:
            kwargs[item.name] = RaggedRows(received[f"{item.name}.values"], received[f"{item.name}.offsets"])
        elif item.name in received:
            kwargs[item.name] = received[item.name]
    return StepBatch(**kwargs)


def prepare_sequences(batch: StepBatch, pad_token_id: int, width: int) -> tuple[PackedSequences, RaggedRows]:
    """The batch's prompt + response sequences and the engine's log-probs (ragged: each mini-batch pads its own rows
    to [rows, width] when it trains)."""
    return pack_sequences(batch.prompt_ids, batch.response_ids, pad_token_id, width), batch.rollout_log_probs


def loss_config_of(config: Config) -> PolicyLossConfig:
    """The policy-loss variant the actor config selects (clip-higher, aggregation, entropy mask, KL, TIS)."""
    actor = config.actor_rollout_ref.actor
    tis = TISConfig(level="token", threshold=actor.tis_imp_ratio_cap) if actor.tis_imp_ratio_cap > 0 else None
    return PolicyLossConfig(clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
                            clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode,
                            entropy_coeff=actor.entropy_coeff, top_entropy_quantile=actor.top_entropy_quantile,
                            use_kl_loss=actor.use_kl_loss,
                            kl_loss_coef=actor.kl_loss_coef, kl_loss_type=actor.kl_loss_type, tis=tis)


def scores_with_kl_penalty(scores: torch.Tensor, log_probs: torch.Tensor, ref_log_probs: torch.Tensor,
                           mask: torch.Tensor, response_lengths: torch.Tensor, kind: str, coef: float
                           ) -> tuple[torch.Tensor, dict[str, float]]:
    """verl's `use_kl_in_reward` for outcome rewards: each response's score, placed on its last token, minus
    `coef` x the per-token KL estimate (`kind`) summed over the response; GRPO then groups these sums."""
    token_scores = token_level_rewards(scores.float(), response_lengths.clamp(min=1), mask.shape[1])
    rewards, metrics = kl_in_reward(token_scores, log_probs, ref_log_probs, mask, kind, coef)
    return rewards.sum(-1), metrics


def _masked_stats(prefix: str, per_response: torch.Tensor) -> dict[str, float]:
    return {f"{prefix}/mean": float(per_response.mean()), f"{prefix}/max": float(per_response.max()),
            f"{prefix}/min": float(per_response.min())}


def train_on_batch(batch: StepBatch, actor: MegatronPolicy, reference: MegatronPolicy | None, config: Config,
                   pad_token_id: int) -> dict[str, float]:
    """Score the batch under the actor (plain and hinted) and the reference, shape advantages, run the PPO epochs."""
    rollout_cfg, actor_cfg, algo = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor, config.algorithm
    temperature = rollout_cfg.temperature or 1.0
    width = config.data.max_response_length
    seqs, rollout_log_probs = prepare_sequences(batch, pad_token_id, width)
    mask = seqs.response_mask()
    metrics: dict[str, float] = {}

    old_log_probs, entropy = actor.log_probs(seqs, temperature)
    ref_log_probs = reference.log_probs(seqs, temperature)[0] if reference is not None else None
    scores = batch.scores
    if algo.use_kl_in_reward:
        scores, kl_metrics = scores_with_kl_penalty(scores, old_log_probs, ref_log_probs, mask, seqs.response_lengths,
                                                    algo.kl_penalty, algo.kl_ctrl.kl_coef)
        metrics.update(kl_metrics)
        metrics["reward/with_kl_mean"] = float(scores.mean())
    advantages = grpo_advantages(scores, batch.group, mask, norm_by_std=algo.norm_adv_by_std_in_grpo)

    if algo.adv_estimator == "cpo":
        hint_log_probs = old_log_probs
        if batch.hint_prompt_ids is not None:
            hint_seqs = pack_sequences(batch.hint_prompt_ids, batch.response_ids, pad_token_id, width)
            hint_log_probs = actor.log_probs(hint_seqs, temperature)[0]
            hint_log_probs = torch.where(batch.has_hint[:, None], hint_log_probs, old_log_probs)
        signals = hint_mi_signals(old_log_probs, hint_log_probs, entropy, mask)
        correct = batch.acc > 0
        difficulty = difficulty_mask(correct, batch.group, levels=3)
        advantages, cpo_metrics = shape_advantages(
            algo.wrap_method, advantages, signals, entropy, mask.bool(), correct, difficulty, old_log_probs,
            hint_log_probs, actor_cfg.pos_alpha, actor_cfg.neg_alpha, actor_cfg.cpo_lambda)
        metrics.update(cpo_metrics)
        mi = signals.mi[mask.bool()]
        metrics.update({"cpo/mi_std": float(mi.std()) if mi.numel() > 1 else 0.0,
                        "cpo/mi_positive_ratio": float((mi > 0).float().mean()) if mi.numel() else 0.0,
                        "cpo/hints_truncated": float(batch.hints_truncated), **(batch.hint_metrics or {})})
        for level, name in ((-1, "all_wrong"), (0, "mixed"), (1, "all_correct")):
            metrics[f"cpo/difficulty_{name}"] = float((difficulty == level).float().mean())
    advantages = scale_advantages(advantages, batch.kept_ratio, actor_cfg.filter_loss_scaling)
    metrics["filter/loss_scale"] = filter_loss_scale(batch.kept_ratio, actor_cfg.filter_loss_scaling)

    loss_config = loss_config_of(config)
    rows_per_mini = actor_cfg.ppo_mini_batch_size * rollout_cfg.n
    update_metrics: list[dict[str, float]] = []
    for _ in range(actor_cfg.ppo_epochs):
        for start in range(0, seqs.rows, rows_per_mini):
            rows = slice(start, start + rows_per_mini)
            engine_log_probs = rollout_log_probs.select(torch.arange(seqs.rows)[rows]).padded(width, 0.0)
            inputs = UpdateInputs(advantages[rows], old_log_probs[rows],
                                  ref_log_probs[rows] if ref_log_probs is not None else None, engine_log_probs)
            update_metrics.append(actor.update(seqs.select(rows), inputs, loss_config, temperature))
    for key in update_metrics[0]:
        metrics[key] = sum(m[key] for m in update_metrics) / len(update_metrics)

    lengths = seqs.response_lengths.float()
    per_response_entropy = masked_mean(entropy, mask, -1)
    metrics.update(_masked_stats("entropy", per_response_entropy))
    metrics.update({
        "completions/mean_length": float(lengths.mean()), "completions/max_length": float(lengths.max()),
        "completions/min_length": float(lengths.min()),
        "completions/clipped_ratio": float(batch.truncated.float().mean()),
        "advantages/mean": float(masked_mean(advantages, mask)),
        "advantages/abs_mean": float(masked_mean(advantages.abs(), mask)),
        "timing/train_tokens": float(mask.sum()),
    })
    if ref_log_probs is not None:
        kl = kl_penalty(old_log_probs, ref_log_probs, actor_cfg.kl_loss_type)
        metrics["kl"] = float(masked_mean(kl, mask))
    return metrics
