"""The hint mutual-information signals of CPO (see docs/cpo.md) from per-token log-probs and entropy.

All five signals are elementwise or per-row masked reductions over ``[responses, T]`` tensors: a handful of fused
elementwise/reduction ops that read each input once, memory-bound and negligible next to the log-prob passes that
produce their inputs. They are therefore plain vectorised torch (see benchmarks/kernels/README.md for timings).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

ENTROPY_RANGE_EPS = 1e-8
MASKED_MEAN_EPS = 1e-10


class HintSignals(NamedTuple):
    """``mi``, ``kl``, ``u``: [N, T]; ``ubar``, ``s``: [N]; float32 (float64 for float64 inputs)."""

    mi: torch.Tensor
    kl: torch.Tensor
    u: torch.Tensor
    ubar: torch.Tensor
    s: torch.Tensor


def hint_mi_signals(log_probs: torch.Tensor, hint_log_probs: torch.Tensor, entropy: torch.Tensor,
                    mask: torch.Tensor) -> HintSignals:
    """CPO's per-token and per-response signals of how much the hint changes the policy.

    From ``lp``, ``lp_h``, ``H`` and ``mask`` [N, T], returns ``HintSignals(mi, kl, u, ubar, s)`` as docs/cpo.md
    ("Notation") defines them: ``kl``, ``mi`` at every position, ``u`` 0 off the mask, ``ubar`` and ``s`` per response.
    """
    shapes = {t.shape for t in (log_probs, hint_log_probs, entropy, mask)}
    if len(shapes) != 1 or log_probs.dim() != 2:
        raise ValueError(f"log_probs, hint_log_probs, entropy and mask must share one [N, T] shape; got "
                         f"{[tuple(t.shape) for t in (log_probs, hint_log_probs, entropy, mask)]}")
    dtype = torch.promote_types(log_probs.dtype, torch.float32)  # bf16 -> float32, float64 stays (exact tests)
    lp, lp_h, ent = log_probs.to(dtype), hint_log_probs.to(dtype), entropy.to(dtype)
    on = mask.bool()
    m = on.to(dtype)
    kl = lp_h - lp
    mi = lp_h.exp() * kl
    ent_min = torch.where(on, ent, float("inf")).amin(dim=-1, keepdim=True)
    ent_max = torch.where(on, ent, float("-inf")).amax(dim=-1, keepdim=True)
    has_tokens = on.any(dim=-1, keepdim=True)
    ent_min = torch.where(has_tokens, ent_min, 0.0)
    ent_max = torch.where(has_tokens, ent_max, 0.0)
    u = torch.where(on, (ent - ent_min) / (ent_max - ent_min + ENTROPY_RANGE_EPS), 0.0)
    count = m.sum(dim=-1) + MASKED_MEAN_EPS
    # select, not multiply: a NaN / inf on padding must not reach the per-response means
    ubar = torch.where(on, ent, 0.0).sum(dim=-1) / count
    return HintSignals(mi, kl, u, ubar, torch.where(on, kl, 0.0).sum(dim=-1) / count)
