"""The k most likely token ids of each position, from vocab-parallel logits or from the final hidden states and the
lm-head without holding the logits: the student's own top-k, which verl's top-k distillation compares with the
teacher's (its overlap metrics). No gradient.

Each rank keeps a running top-k over bounded tiles of its vocabulary slice (the padded columns left out), then the
tensor-parallel group exchanges its k candidates (values and global ids: two all-gathers of [tokens, k]) and keeps
the best k. Ranking by logits is ranking by log-probs (the log-normaliser is shared by a token's ids), at any
positive temperature. Costs one more pass of the lm-head matmul over the vocabulary, in chunked torch on every
device.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cpo.kernels.softmax_stats import VocabShard

TILE_ELEMENTS = 1 << 24  # float32 logits of one tile (64 MiB)
VOCAB_TILE = 8192


def _merge(best: tuple[torch.Tensor, torch.Tensor], values: torch.Tensor, ids: torch.Tensor, k: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest of the running `best` (values, ids) and a tile's candidates."""
    all_values, all_ids = torch.cat([best[0], values], -1), torch.cat([best[1], ids], -1)
    top = torch.topk(all_values, k, dim=-1)
    return top.values, all_ids.gather(-1, top.indices)


def _local_top_k(logits_of, num_tokens: int, n_valid: int, start: int, k: int, device: torch.device,
                 width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's k best (values, global ids) per token over its `n_valid` columns; `logits_of(b, e, vb, ve)` gives
    a float32 tile. Slots beyond the slice's width hold -inf and id -1."""
    values = torch.full((num_tokens, k), float("-inf"), device=device)
    ids = torch.full((num_tokens, k), -1, dtype=torch.int64, device=device)
    vocab_tile = min(VOCAB_TILE, max(n_valid, 1))
    token_chunk = max(1, TILE_ELEMENTS // max(1, min(width, vocab_tile)))
    for b in range(0, num_tokens, token_chunk):
        e = min(b + token_chunk, num_tokens)
        best = (values[b:e], ids[b:e])
        for vb in range(0, n_valid, vocab_tile):
            ve = min(vb + vocab_tile, n_valid)
            tile = logits_of(b, e, vb, ve)
            top = torch.topk(tile, min(k, ve - vb), dim=-1)
            best = _merge(best, top.values, top.indices + (start + vb), k)
        values[b:e], ids[b:e] = best
    return values, ids


def _across_ranks(values: torch.Tensor, ids: torch.Tensor, k: int, tp_group: dist.ProcessGroup | None
                  ) -> torch.Tensor:
    if tp_group is None:
        return ids
    world = dist.get_world_size(tp_group)
    all_values = [torch.empty_like(values) for _ in range(world)]
    all_ids = [torch.empty_like(ids) for _ in range(world)]
    dist.all_gather(all_values, values.contiguous(), group=tp_group)
    dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
    top = torch.topk(torch.cat(all_values, -1), k, dim=-1)
    return torch.cat(all_ids, -1).gather(-1, top.indices)


def _check_k(k: int, vocab_size: int) -> None:
    if not 0 < k <= vocab_size:
        raise ValueError(f"k={k} must be in [1, {vocab_size}] (the real vocabulary)")


@torch.no_grad()
def logits_top_k(logits: torch.Tensor, k: int, tp_group: dist.ProcessGroup | None = None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """Global ids [..., k] of each position's k largest logits (this rank holds columns of the vocabulary as in
    `log_probs_and_entropy`), best first."""
    logits2d = logits.reshape(-1, logits.shape[-1])
    shard = VocabShard.of_rank(logits2d.shape[-1], tp_group, vocab_size)
    _check_k(k, shard.vocab_size)
    values, ids = _local_top_k(lambda b, e, vb, ve: logits2d[b:e, vb:ve].float(), logits2d.shape[0], shard.n_valid,
                               shard.start, k, logits.device, logits2d.shape[-1])
    return _across_ranks(values, ids, k, tp_group).reshape(*logits.shape[:-1], k)


@torch.no_grad()
def linear_top_k(hidden: torch.Tensor, weight: torch.Tensor, k: int, tp_group: dist.ProcessGroup | None = None,
                 vocab_size: int | None = None) -> torch.Tensor:
    """`logits_top_k(hidden @ weight.T, ...)` without holding the logits: `weight` is this rank's [V_local, H]
    lm-head rows, `hidden` [..., H] replicated over `tp_group`."""
    hidden2d = hidden.reshape(-1, hidden.shape[-1])
    shard = VocabShard.of_rank(weight.shape[0], tp_group, vocab_size)
    _check_k(k, shard.vocab_size)
    values, ids = _local_top_k(lambda b, e, vb, ve: hidden2d[b:e].float() @ weight[vb:ve].float().T,
                               hidden2d.shape[0], shard.n_valid, shard.start, k, hidden.device, hidden2d.shape[-1])
    return _across_ranks(values, ids, k, tp_group).reshape(*hidden.shape[:-1], k)
