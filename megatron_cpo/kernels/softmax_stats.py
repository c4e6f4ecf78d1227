"""Softmax statistics shared by every backend: the vocab shard a rank owns, partial statistics and their combination.

A backend reduces its slice of the (temperature-scaled) logits ``z`` of each token to four float32 numbers:

- ``max``: the largest ``z`` in the slice (``-inf`` for an empty slice),
- ``sum_exp``: ``sum exp(z - max)``,
- ``sum_exp_shift``: ``sum exp(z - max) * (z - max)`` (kept relative to ``max`` so that logits of +-1e4 do not cancel
  catastrophically when the entropy is formed),
- ``target_z``: ``z`` of the target token if the slice holds it, else 0 (with k ids per token: [tokens, k]).

Partial statistics of disjoint slices (vocabulary tiles inside one rank, then tensor-parallel ranks) combine exactly,
so the per-token log-prob ``z_t - logsumexp(z)`` and entropy ``logsumexp(z) - E_p[z]`` come out of a single pass over
the logits. Across a tensor-parallel group this costs two all-reduces of ``[tokens]`` vectors (max, then one stacked
sum), the reductions Megatron's vocab-parallel cross entropy performs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist


class SoftmaxStats(NamedTuple):
    """Per-token partial softmax statistics of one vocabulary slice (float32, [tokens]; `target_z` [tokens, k] when
    each token has k ids)."""

    max: torch.Tensor
    sum_exp: torch.Tensor
    sum_exp_shift: torch.Tensor
    target_z: torch.Tensor


class LogProbsEntropy(NamedTuple):
    """Per-token float32 results: log-prob of the target (of each of k ids: [tokens, k]), entropy, and
    ``logsumexp(z) = max + log_sum_exp``.

    Backward forms ``log p = (z - max) - log_sum_exp``: with logits near 1e4 a float32 ``logsumexp`` would already
    carry an error of 5e-4, which ``z - max`` (exact) and a small ``log_sum_exp`` avoid.
    """

    log_probs: torch.Tensor
    entropy: torch.Tensor
    max: torch.Tensor
    log_sum_exp: torch.Tensor


@dataclass(frozen=True)
class VocabShard:
    """The contiguous vocabulary slice ``[start, start + local_size)`` held by one tensor-parallel rank.

    ``n_valid`` counts the slice's columns that are real vocabulary entries: Megatron pads the vocabulary to a multiple
    of ``make_vocab_size_divisible_by * TP``; columns at global id ``>= vocab_size`` are excluded from the softmax and
    receive zero gradient.
    """

    start: int
    local_size: int
    n_valid: int
    vocab_size: int

    @classmethod
    def of_rank(cls, local_size: int, tp_group: dist.ProcessGroup | None, vocab_size: int | None) -> VocabShard:
        """Describe this rank's slice, given the local width of the logits and the real (unpadded) vocabulary size."""
        rank = dist.get_rank(tp_group) if tp_group is not None else 0
        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        padded = local_size * world
        real = padded if vocab_size is None else int(vocab_size)
        if not 0 < real <= padded:
            raise ValueError(f"vocab_size={vocab_size} must lie in [1, {padded}] (local vocab {local_size} x TP "
                             f"{world}); pass the real vocabulary size or None when the logits hold no padding")
        start = rank * local_size
        return cls(start=start, local_size=local_size, n_valid=max(0, min(local_size, real - start)), vocab_size=real)

    def localize(self, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        """Target ids relative to this slice; -1 where the slice does not hold the target or the token is ignored."""
        bad = (targets != ignore_index) & ((targets < 0) | (targets >= self.vocab_size))
        if bool(bad.any()):
            raise ValueError(f"target id {int(targets[bad][0])} is outside the vocabulary [0, {self.vocab_size}); "
                             f"mark padding with ignore_index={ignore_index} or pass the right vocab_size")
        local = targets.to(torch.int64) - self.start
        owned = (targets != ignore_index) & (local >= 0) & (local < self.n_valid)
        return torch.where(owned, local, torch.full_like(local, -1)).contiguous()


def empty_stats(num_tokens: int, device: torch.device) -> SoftmaxStats:
    """Statistics of an empty slice (a rank whose columns are all vocabulary padding)."""
    zeros = torch.zeros(num_tokens, dtype=torch.float32, device=device)
    return SoftmaxStats(torch.full_like(zeros, float("-inf")), zeros, zeros.clone(), zeros.clone())


def tile_stats(z: torch.Tensor, local_targets: torch.Tensor) -> SoftmaxStats:
    """Statistics of a float32 scratch tile ``z`` [tokens, cols] (overwritten); ``local_targets`` index its columns."""
    held = (local_targets >= 0) & (local_targets < z.shape[-1])
    picked = z.gather(-1, local_targets.clamp(0, z.shape[-1] - 1).unsqueeze(-1)).squeeze(-1)
    z_max = z.amax(dim=-1)
    shifted = z.sub_(z_max.unsqueeze(-1))
    exp = shifted.exp()
    return SoftmaxStats(z_max, exp.sum(-1), shifted.mul_(exp).sum(-1), torch.where(held, picked, 0.0))


def _rescaled(stats: SoftmaxStats, new_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sum_exp`` and ``sum_exp_shift`` of ``stats`` re-expressed relative to ``new_max`` (>= stats.max)."""
    finite_max = torch.where(torch.isfinite(new_max), new_max, torch.zeros_like(new_max))
    nonempty = stats.sum_exp > 0
    delta = torch.where(nonempty, stats.max - finite_max, torch.zeros_like(finite_max))
    scale = torch.where(nonempty, delta.exp(), torch.zeros_like(delta))
    return stats.sum_exp * scale, torch.where(nonempty, scale * (stats.sum_exp_shift + stats.sum_exp * delta), scale)


def combine_partials(parts: SoftmaxStats) -> SoftmaxStats:
    """Combine partial statistics stacked along dim 0 (disjoint vocabulary slices) into one slice's statistics."""
    new_max = parts.max.amax(dim=0)
    sum_exp, sum_exp_shift = _rescaled(parts, new_max.unsqueeze(0))
    return SoftmaxStats(new_max, sum_exp.sum(0), sum_exp_shift.sum(0), parts.target_z.sum(0))


def finalize(stats: SoftmaxStats, tp_group: dist.ProcessGroup | None) -> LogProbsEntropy:
    """Reduce a rank's statistics over the tensor-parallel group and form log-probs, entropy and log-sum-exp.

    ``target_z`` is [tokens] (one target per token) or [tokens, k] (k ids per token, ``log_probs`` then [tokens, k]);
    either way the k values ride in the one summed all-reduce."""
    global_max = stats.max.clone()
    if tp_group is not None:
        dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    sum_exp, sum_exp_shift = _rescaled(stats, global_max)
    targets = stats.target_z.reshape(stats.target_z.shape[0], -1).T
    sums = torch.cat([torch.stack([sum_exp, sum_exp_shift]), targets])
    if tp_group is not None:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=tp_group)
    sum_exp, sum_exp_shift = sums[0], sums[1]
    target_z = sums[2:].T.reshape(stats.target_z.shape)
    log_sum_exp = sum_exp.log()
    entropy = log_sum_exp - sum_exp_shift / sum_exp
    per_target = (-1,) + (1,) * (target_z.dim() - 1)
    return LogProbsEntropy(target_z - global_max.view(per_target) - log_sum_exp.view(per_target), entropy, global_max,
                           log_sum_exp)


def grad_of_z(z: torch.Tensor, local_targets: torch.Tensor, z_max: torch.Tensor, log_sum_exp: torch.Tensor,
              entropy: torch.Tensor, grad_log_probs: torch.Tensor, grad_entropy: torch.Tensor) -> torch.Tensor:
    """Gradient w.r.t. a float32 tile ``z`` [tokens, cols] of ``sum(g_lp * log_prob + g_H * entropy)``.

    ``d log p_t / d z_j = 1[j = t] - p_j`` and ``d H / d z_j = -p_j (log p_j + H)``. Overwrites ``z`` (a scratch
    tile) with the result, so the tile costs two float32 buffers in all.
    """
    log_p = z.sub_(z_max.unsqueeze(-1)).sub_(log_sum_exp.unsqueeze(-1))
    p = log_p.exp()
    grad = log_p.add_(entropy.unsqueeze(-1)).mul_(grad_entropy.unsqueeze(-1)).add_(grad_log_probs.unsqueeze(-1))
    grad.mul_(p).neg_()
    held = (local_targets >= 0) & (local_targets < z.shape[-1])
    return grad.scatter_add_(-1, local_targets.clamp(0, z.shape[-1] - 1).unsqueeze(-1),
                             torch.where(held, grad_log_probs, 0.0).unsqueeze(-1))
