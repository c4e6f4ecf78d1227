"""Loss aggregation (`actor_rollout_ref.actor.loss_agg_mode`, verl's modes plus `token-sum`): a per-token loss [N, T]
to one number. Given the global token / sequence counts of the whole batch, each call returns this micro-batch's
additive share, so the result does not depend on the split (a trainer whose DP reduction averages multiplies by the
DP size). `seq-mean-token-sum-norm` is Dr.GRPO's `sum_i sum_t loss / (num_seqs * L)` (verl omits the 1/num_seqs).
"""
from collections.abc import Callable

import torch

from megatron_cpo.algorithms.masked import masked_sum


def _token_mean(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask) / (global_tokens if global_tokens is not None else mask.sum().clamp(min=1))


def _token_sum(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask)


def _seq_count(mask, global_seqs):
    return global_seqs if global_seqs is not None else (mask.sum(-1) > 0).sum().clamp(min=1)


def _seq_mean_token_sum(values, mask, global_tokens, global_seqs, norm_length):
    return masked_sum(values, mask) / _seq_count(mask, global_seqs)


def _seq_mean_token_mean(values, mask, global_tokens, global_seqs, norm_length):
    per_seq = masked_sum(values, mask, -1) / mask.sum(-1).clamp(min=1)
    return per_seq.sum() / _seq_count(mask, global_seqs)


def _seq_mean_token_sum_norm(values, mask, global_tokens, global_seqs, norm_length):
    length = norm_length if norm_length is not None else mask.shape[-1]
    return masked_sum(values, mask) / (_seq_count(mask, global_seqs) * length)


LOSS_AGGREGATIONS: dict[str, Callable] = {  # keyed by config.LOSS_AGGREGATION_MODES
    "token-mean": _token_mean,
    "token-sum": _token_sum,
    "seq-mean-token-sum": _seq_mean_token_sum,
    "seq-mean-token-mean": _seq_mean_token_mean,
    "seq-mean-token-sum-norm": _seq_mean_token_sum_norm,
}


def check_loss_agg_mode(mode: str) -> None:
    """Raise a clear error for an unknown aggregation mode."""
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {sorted(LOSS_AGGREGATIONS)}")


def aggregate_loss(
    values: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    global_tokens: float | None = None,
    global_seqs: float | None = None,
    norm_length: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss Tensor[N, T] to a scalar with `mode`.

    global_tokens / global_seqs: counts over the whole batch (all micro-batches, all DP ranks); with them the result
    is this micro-batch's additive share, without them the local loss. Sequences with no unmasked token do not count.
    norm_length: the constant L of `seq-mean-token-sum-norm` (default T, the padded response length).
    Padded positions are ignored whatever they hold (NaN / inf included; `masked.masked_sum`).
    """
    check_loss_agg_mode(mode)
    if global_tokens is not None and global_tokens <= 0:
        raise ValueError(f"global_tokens={global_tokens} must be > 0 (the unmasked tokens of the whole batch)")
    if global_seqs is not None and global_seqs <= 0:
        raise ValueError(f"global_seqs={global_seqs} must be > 0 (the non-empty responses of the whole batch)")
    mask = mask.to(values.dtype)
    return LOSS_AGGREGATIONS[mode](values, mask, global_tokens, global_seqs, norm_length)
