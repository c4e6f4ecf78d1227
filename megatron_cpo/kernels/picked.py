"""The logits of k given ids per token, and their share of the gradient: what takes the fused log-prob kernels from one
target to k (top-k distillation's student log-probs at the teacher's ids).

The softmax statistics over the whole vocabulary come from a backend (chunked torch or Triton) run without targets;
the k picked logits are a gather-dot over the lm-head rows of the ids, `z_i = h . w_{id_i} / T`, costing N x k x H
multiply-adds against the N x V x H of the statistics, so they are plain torch on every backend, in float32, over
bounded token chunks. Backward: `d log p_i / d z_j = 1[j = id_i] - p_j`; the backend applies `-p_j sum_i g_i` (one
target of gradient `sum_i g_i` that no column matches) and these functions add `g_i` at each id: through the id's
lm-head row into the hidden gradient, and through the hidden state into that row's weight gradient.
"""
from __future__ import annotations

import torch

TILE_ELEMENTS = 1 << 24  # float32 values of gathered lm-head rows held at once (64 MiB)


def _row_chunks(num_tokens: int, k: int, width: int) -> list[tuple[int, int]]:
    size = max(1, TILE_ELEMENTS // max(1, k * width))
    return [(begin, min(begin + size, num_tokens)) for begin in range(0, num_tokens, size)]


def picked_linear_logits(hidden: torch.Tensor, weight: torch.Tensor, local_ids: torch.Tensor,
                         inv_temp: float) -> torch.Tensor:
    """``(hidden @ weight[id].T) * inv_temp`` for each of the [N, k] ids this rank holds (`local_ids` >= 0), 0 for
    the others; float32 [N, k]."""
    out = torch.zeros(local_ids.shape, dtype=torch.float32, device=hidden.device)
    owned = local_ids >= 0
    rows = local_ids.clamp_min(0)
    for b, e in _row_chunks(hidden.shape[0], local_ids.shape[1], hidden.shape[1]):
        gathered = weight[rows[b:e]].float()  # [c, k, H]
        out[b:e] = torch.bmm(gathered, hidden[b:e].float().unsqueeze(-1)).squeeze(-1).mul_(inv_temp)
    return torch.where(owned, out, 0.0)


def add_picked_linear_grads(hidden: torch.Tensor, weight: torch.Tensor, local_ids: torch.Tensor,
                            grad_ids: torch.Tensor, inv_temp: float, grad_hidden: torch.Tensor,
                            grad_weight: torch.Tensor) -> None:
    """Add each owned id's `g_i * inv_temp` through its lm-head row: `grad_hidden += sum_i c_i w_{id_i}`,
    `grad_weight[id_i] += c_i h` (in place; `grad_ids` float32 [N, k], 0 where the id is ignored)."""
    coeff = torch.where(local_ids >= 0, grad_ids, 0.0) * inv_temp
    rows = local_ids.clamp_min(0)
    for b, e in _row_chunks(hidden.shape[0], local_ids.shape[1], hidden.shape[1]):
        gathered = weight[rows[b:e]].float()  # [c, k, H]
        grad_hidden[b:e] += torch.bmm(coeff[b:e].unsqueeze(1), gathered).squeeze(1).to(grad_hidden.dtype)
        rows_grad = coeff[b:e].unsqueeze(-1) * hidden[b:e].float().unsqueeze(1)  # [c, k, H]
        grad_weight.index_add_(0, rows[b:e].reshape(-1), rows_grad.reshape(-1, hidden.shape[1]).to(grad_weight.dtype))


def picked_logits(logits: torch.Tensor, local_ids: torch.Tensor, inv_temp: float) -> torch.Tensor:
    """``logits[id] * inv_temp`` for each owned id of [N, k], 0 for the others; float32."""
    picked = logits.gather(-1, local_ids.clamp_min(0)).float() * inv_temp
    return torch.where(local_ids >= 0, picked, 0.0)


def add_picked_logits_grads(local_ids: torch.Tensor, grad_ids: torch.Tensor, inv_temp: float,
                            grad_logits: torch.Tensor) -> None:
    """``grad_logits[id_i] += g_i * inv_temp`` for each owned id (in place)."""
    coeff = torch.where(local_ids >= 0, grad_ids, 0.0) * inv_temp
    grad_logits.scatter_add_(-1, local_ids.clamp_min(0), coeff.to(grad_logits.dtype))
