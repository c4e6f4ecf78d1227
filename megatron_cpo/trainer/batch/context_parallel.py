"""Context parallelism of the padded rows (`actor_rollout_ref.actor.megatron.context_parallel_size`, Transformer
Engine only): each CP rank holds two chunks of every row (Megatron's load-balanced split), and the per-position
results are all-gathered back with autograd. Why the gradients come out right: docs/trainer.md.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def chunk_index(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The columns of a row of `length` (a multiple of 2 x CP) that CP rank `cp_rank` holds, in order."""
    if length % (2 * cp_size):
        raise ValueError(f"a row of {length} tokens cannot be split into 2 x {cp_size} context-parallel chunks; pad "
                         f"it to a multiple of {2 * cp_size}")
    chunk = length // (2 * cp_size)
    columns = torch.arange(length).view(2 * cp_size, chunk)
    return torch.cat([columns[cp_rank], columns[2 * cp_size - 1 - cp_rank]])


def gather_positions(local: torch.Tensor, length: int, group: dist.ProcessGroup) -> torch.Tensor:
    """`[b, L / CP]` per-position values of this rank's chunks -> `[b, L]` of the whole rows (differentiable)."""
    from torch.distributed.nn.functional import all_gather

    cp_size = dist.get_world_size(group)
    pieces = all_gather(local.contiguous(), group=group)
    order = torch.cat([chunk_index(length, cp_size, rank) for rank in range(cp_size)]).to(local.device)
    return torch.cat(pieces, dim=1)[:, torch.argsort(order)]
