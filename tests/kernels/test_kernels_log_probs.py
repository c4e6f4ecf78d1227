"""Forward and backward of both log-prob kernels against float64 references, on every backend (Triton interpreted).

Sizes are deliberately awkward: 29 tokens and a vocabulary of 203 are not multiples of any tile size used.
"""
from __future__ import annotations

import pytest
import torch
from kernel_test_utils import SMALL_BACKENDS, log_probs_entropy64, objective, rel_error

from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy

N, V, H = 29, 203, 40
FLOAT32_TOL = 1e-5
BF16_TOL = 1e-2


def _targets(gen: torch.Generator, vocab: int, ignore_index: int = -100) -> torch.Tensor:
    targets = torch.randint(0, vocab, (N,), generator=gen)
    targets[[2, 11, 17]] = ignore_index
    return targets


def _upstream(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(N, generator=gen, dtype=torch.float64), torch.randn(N, generator=gen, dtype=torch.float64)


def _logits(gen: torch.Generator, case: str) -> torch.Tensor:
    logits = torch.randn(N, V, generator=gen, dtype=torch.float64) * 3
    if case == "extreme":
        logits[::3, 5] = 1e4
        logits[::4, 7] = 1e4
        logits[1::2, 20:60] = -1e4
    return logits


LOGITS_CASES = {  # name: (dtype, temperature, tolerance)
    "fp32": (torch.float32, 0.7, FLOAT32_TOL),
    "bf16": (torch.bfloat16, 1.3, BF16_TOL),
    "extreme": (torch.float32, 1.0, FLOAT32_TOL),
}


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
@pytest.mark.parametrize("case", LOGITS_CASES)
def test_logits_kernel_matches_float64(impl, case):
    dtype, temperature, tol = LOGITS_CASES[case]
    gen = torch.Generator().manual_seed(list(LOGITS_CASES).index(case))
    logits = _logits(gen, case).to(dtype)
    targets = _targets(gen, V)
    if case == "extreme":
        targets[::3] = 5
    grad_lp, grad_ent = _upstream(gen)
    ref_input = logits.double().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64(ref_input, targets, temperature)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent, grad_lp, grad_ent), ref_input)

    x = logits.clone().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, temperature, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(objective(lp, ent, grad_lp, grad_ent), x)

    assert lp.dtype == ent.dtype == torch.float32 and grad.dtype == dtype
    for out in (lp, ent, grad):
        assert torch.isfinite(out).all()
    assert rel_error(lp, ref_lp) < tol
    assert rel_error(ent, ref_ent) < tol
    assert rel_error(grad, ref_grad) < tol
    ignored = targets == -100
    assert (lp[ignored] == 0).all() and (ent[ignored] == 0).all() and (grad[ignored] == 0).all()


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
def test_padded_vocab_columns_are_excluded(impl):
    gen = torch.Generator().manual_seed(1)
    real = _logits(gen, "fp32")
    padded = torch.cat([real, torch.full((N, 13), 50.0, dtype=torch.float64)], dim=-1)
    targets = _targets(gen, V, ignore_index=-1)
    grad_lp, grad_ent = _upstream(gen)
    ref_input = real.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64(ref_input, targets, 1.0, ignore_index=-1)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent, grad_lp, grad_ent), ref_input)

    x = padded.float().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, ignore_index=-1, vocab_size=V, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(objective(lp, ent, grad_lp, grad_ent), x)
    assert rel_error(lp, ref_lp) < FLOAT32_TOL and rel_error(ent, ref_ent) < FLOAT32_TOL
    assert rel_error(grad[:, :V], ref_grad) < FLOAT32_TOL
    assert (grad[:, V:] == 0).all()


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
def test_leading_dims_and_entropy_only_backward(impl):
    gen = torch.Generator().manual_seed(2)
    logits = _logits(gen, "fp32")[:14].reshape(2, 7, V)
    targets = _targets(gen, V)[:14].reshape(2, 7)
    ref_input = logits.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64(ref_input, targets, 1.0)
    (ref_grad,) = torch.autograd.grad(ref_ent.sum(), ref_input)
    x = logits.float().requires_grad_()
    lp, ent = log_probs_and_entropy(x, targets, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(ent.sum(), x)
    assert lp.shape == ent.shape == targets.shape
    assert rel_error(lp, ref_lp) < FLOAT32_TOL and rel_error(grad, ref_grad) < FLOAT32_TOL


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
def test_logits_sliced_from_a_wider_buffer(impl):
    """Logits that are a column slice of a wider buffer (row stride > V): the gradient is dense [N, V] and correct.

    The Triton backward once wrote the dense gradient with the input's row stride (out of bounds on CUDA; a crash or
    garbage under the interpreter)."""
    gen = torch.Generator().manual_seed(5)
    logits = _logits(gen, "fp32")
    targets = _targets(gen, V)
    ref_input = logits.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64(ref_input, targets, 0.9)
    (ref_grad,) = torch.autograd.grad((ref_lp + ref_ent).sum(), ref_input)
    wide = torch.cat([logits, torch.randn(N, 37, generator=gen, dtype=torch.float64)], dim=1).float()
    wide.requires_grad_()
    lp, ent = log_probs_and_entropy(wide[:, :V], targets, temperature=0.9, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad((lp + ent).sum(), wide)
    assert rel_error(lp, ref_lp) < FLOAT32_TOL and rel_error(grad[:, :V], ref_grad) < FLOAT32_TOL
    assert (grad[:, V:] == 0).all()


LINEAR_CASES = {  # name: (dtype, temperature, tolerance)
    "fp32": (torch.float32, 0.7, FLOAT32_TOL),
    "bf16": (torch.bfloat16, 1.3, BF16_TOL),
    "extreme": (torch.float32, 1.0, FLOAT32_TOL),
}


def _linear_inputs(gen: torch.Generator, case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 hidden [N, H] and lm-head [V + 5, H] (5 padding rows), exactly representable in the case's dtype.

    "extreme": small integers times 1/4 plus a +-1e4 component on every fifth vocabulary row, so that every partial
    sum of the matmul is exact in float32 and the logits reach +-1e4 (+ O(10)) with a non-degenerate softmax.
    """
    if case != "extreme":
        dtype = LINEAR_CASES[case][0]
        hidden = torch.randn(N, H, generator=gen, dtype=torch.float64).to(dtype).double()
        weight = (torch.randn(V + 5, H, generator=gen, dtype=torch.float64) * 4 / H**0.5).to(dtype).double()
        return hidden, weight
    hidden = torch.randint(-2, 3, (N, H), generator=gen).double()
    weight = torch.randint(-1, 2, (V + 5, H), generator=gen).double() / 4
    hidden[:, 0] = torch.where(torch.arange(N) % 2 == 0, 1e4, -1e4)
    weight[:, 0] = (torch.arange(V + 5) % 5 == 0).double()
    return hidden, weight


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
@pytest.mark.parametrize("case", LINEAR_CASES)
def test_linear_kernel_matches_float64(impl, case):
    dtype, temperature, tol = LINEAR_CASES[case]
    gen = torch.Generator().manual_seed(10 + list(LINEAR_CASES).index(case))
    hidden, weight = _linear_inputs(gen, case)
    targets = _targets(gen, V)
    grad_lp, grad_ent = _upstream(gen)
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64((ref_h @ ref_w.T)[:, :V], targets, temperature)
    ref_gh, ref_gw = torch.autograd.grad(objective(ref_lp, ref_ent, grad_lp, grad_ent), (ref_h, ref_w))

    h, w = hidden.to(dtype).requires_grad_(), weight.to(dtype).requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h, w, targets, temperature, vocab_size=V, impl=SMALL_BACKENDS[impl])
    gh, gw = torch.autograd.grad(objective(lp, ent, grad_lp, grad_ent), (h, w))

    assert gh.dtype == gw.dtype == dtype
    for out in (lp, ent, gh, gw):
        assert torch.isfinite(out).all()
    assert rel_error(lp, ref_lp) < tol
    assert rel_error(ent, ref_ent) < tol
    assert rel_error(gh, ref_gh) < tol
    assert rel_error(gw, ref_gw) < tol
    assert (gw[V:] == 0).all()


def test_backends_agree_on_auto_dispatch():
    gen = torch.Generator().manual_seed(3)
    logits = _logits(gen, "fp32").float()
    targets = _targets(gen, V)
    auto = log_probs_and_entropy(logits, targets)
    chunked = log_probs_and_entropy(logits, targets, impl="torch")
    assert all(torch.equal(a, b) for a, b in zip(auto, chunked))


def test_bad_inputs_name_the_value_and_the_fix():
    logits = torch.zeros(4, 10)
    targets = torch.tensor([1, 2, 10, -100])
    with pytest.raises(ValueError, match=r"target id 10 is outside the vocabulary \[0, 10\)"):
        log_probs_and_entropy(logits, targets, impl="torch")
    with pytest.raises(ValueError, match=r"vocab_size=11 must lie in \[1, 10\]"):
        log_probs_and_entropy(logits, targets.clamp(max=3), vocab_size=11)
    with pytest.raises(ValueError, match=r"target id 9 is outside the vocabulary \[0, 8\)"):
        log_probs_and_entropy(logits, torch.tensor([1, 9, 0, 0]), vocab_size=8)
    with pytest.raises(ValueError, match="temperature=0.0 must be > 0"):
        log_probs_and_entropy(logits, targets.clamp(max=3), temperature=0.0)
    with pytest.raises(ValueError, match="impl='cuda' is unknown"):
        log_probs_and_entropy(logits, targets.clamp(max=3), impl="cuda")
    with pytest.raises(ValueError, match="dtype torch.int64"):
        log_probs_and_entropy(logits.long(), targets.clamp(max=3))
    with pytest.raises(ValueError, match=r"must be \[V_local, 10\]"):
        linear_log_probs_and_entropy(logits, torch.zeros(7, 9), targets.clamp(max=3))


def test_triton_linear_kernels_refuse_offsets_past_int32():
    """The linear kernels form ``row * row_stride`` in 32 bits: 2^20 tokens x 2048 hidden = 2^31 elements would wrap
    (so would a 152064 x 16384 lm-head at TP=1); the backend says so instead of reading the wrong memory."""
    from megatron_cpo.kernels import TritonBackend

    TritonBackend._check_offsets("hidden", 2**20, 2**11 - 1)
    with pytest.raises(ValueError, match=r"hidden spans 1048576 x 2048 elements.*impl='torch'"):
        TritonBackend._check_offsets("hidden", 2**20, 2**11)
    with pytest.raises(ValueError, match="weight spans 152064 x 16384"):
        TritonBackend._check_offsets("weight", 152064, 16384)
