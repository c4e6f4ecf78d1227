"""CPO hint signals against the spec's definitions (float64, per response) and a hand-computed case."""
from __future__ import annotations

import math

import pytest
import torch
from kernel_test_utils import hint_signals64

from megatron_cpo.kernels import hint_mi_signals


def test_hand_computed_response():
    lp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    lp_h = torch.tensor([[-0.5, -2.0, -1.0, -9.0]])
    entropy = torch.tensor([[1.0, 3.0, 2.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    mi, kl, u, ubar, s = hint_mi_signals(lp, lp_h, entropy, mask)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, -0.5, -6.0]]))
    assert torch.allclose(mi, torch.tensor([[math.exp(-0.5) * 0.5, 0.0, math.exp(-1.0) * -0.5, math.exp(-9) * -6]]))
    assert torch.allclose(u, torch.tensor([[0.0, 1.0, 0.5, 0.0]]), atol=1e-7)  # min 1, max 3 over the mask
    assert torch.allclose(ubar, torch.tensor([2.0])) and torch.allclose(s, torch.tensor([0.0]))


def test_matches_spec_on_random_batches():
    gen = torch.Generator().manual_seed(0)
    n, t = 9, 23
    lp = -torch.rand(n, t, generator=gen) * 5
    lp_h = -torch.rand(n, t, generator=gen) * 5
    entropy = torch.rand(n, t, generator=gen) * 4
    mask = torch.rand(n, t, generator=gen) > 0.3
    mask[0] = False  # a response with no tokens: u = 0, ubar = s = 0
    mask[1] = False
    mask[1, 5] = True  # a single token: u = 0 there
    got = hint_mi_signals(lp, lp_h, entropy, mask)
    want = hint_signals64(lp, lp_h, entropy, mask)
    for name, a, b in zip(got._fields, got, want):
        assert a.dtype == torch.float32 and a.shape == b.shape, name
        assert torch.allclose(a.double(), b, rtol=1e-5, atol=1e-6), name
    assert (got.u[0] == 0).all() and got.ubar[0] == 0 and got.s[0] == 0


def test_shape_mismatch_is_reported():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match=r"\[\(2, 3\), \(2, 3\), \(2, 4\), \(2, 3\)\]"):
        hint_mi_signals(x, x, torch.zeros(2, 4), x)
