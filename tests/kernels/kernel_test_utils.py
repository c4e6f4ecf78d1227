"""Helpers for the kernel tests: float64 references (materialised softmax over the real vocabulary), small tiles."""
from __future__ import annotations

import torch

from megatron_cpo.kernels import TorchChunkedBackend, TritonBackend


def log_probs_entropy64(logits: torch.Tensor, targets: torch.Tensor, temperature: float,
                       ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-prob of the target and entropy, in float64, 0 where the target is ignored."""
    log_p = torch.log_softmax(logits.double() / temperature, dim=-1)
    ignored = targets == ignore_index
    picked = log_p.gather(-1, targets.masked_fill(ignored, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).nan_to_num(0.0).sum(-1)
    return picked.masked_fill(ignored, 0.0), entropy.masked_fill(ignored, 0.0)


def objective(log_probs: torch.Tensor, entropy: torch.Tensor, grad_lp: torch.Tensor,
              grad_ent: torch.Tensor) -> torch.Tensor:
    """A scalar that weights both outputs with random upstream gradients, so backward checks both paths."""
    return (log_probs.double() * grad_lp.double()).sum() + (entropy.double() * grad_ent.double()).sum()


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected| (float64)."""
    actual, expected = actual.detach().double(), expected.detach().double()
    return float((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30))


def hint_signals64(lp, lp_h, ent, mask):
    """The spec's definitions of mi, kl, u, ubar, s written out per response (float64, loops are fine here)."""
    lp, lp_h, ent, m = lp.double(), lp_h.double(), ent.double(), mask.double()
    kl = lp_h - lp
    mi = lp_h.exp() * kl
    u = torch.zeros_like(ent)
    for i in range(ent.shape[0]):
        on = m[i] > 0
        if on.any():
            lo, hi = ent[i][on].min(), ent[i][on].max()
            u[i][on] = (ent[i][on] - lo) / (hi - lo + 1e-8)
    count = m.sum(-1) + 1e-10
    return mi, kl, u, (ent * m).sum(-1) / count, (kl * m).sum(-1) / count


# Backends with small tiles so that the awkward test sizes cross several tiles, vocabulary splits and token chunks.
SMALL_TRITON = TritonBackend(logits_block_v=64, block_n=16, block_v=32, block_k=16, min_programs=8,
                             grad_chunk_bytes=16 * 128 * 4)
SMALL_TORCH = TorchChunkedBackend(tile_elements=7 * 64, vocab_tile=64)
SMALL_BACKENDS = {"triton": SMALL_TRITON, "torch": SMALL_TORCH}
