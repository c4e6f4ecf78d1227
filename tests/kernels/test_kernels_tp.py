"""Tensor parallelism: two gloo processes each hold half of a padded vocabulary; results must match one float64 run.

Covers both kernels on both backends, forward and backward, temperature != 1, ignored tokens, and two paddings:
vocabulary 203 padded to 204 (rank 1 holds one padding column) and vocabulary 100 padded to 204 (rank 1 holds only
padding, rank 0 two padding columns).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from kernel_test_utils import SMALL_BACKENDS, log_probs_entropy64, objective, rel_error

from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy
from tests.multiprocess import run_processes

N, LOCAL_V, H, TEMPERATURE = 19, 102, 24, 0.8


def _inputs(vocab_size: int):
    gen = torch.Generator().manual_seed(vocab_size)
    logits = torch.randn(N, 2 * LOCAL_V, generator=gen, dtype=torch.float64) * 3
    logits[:, vocab_size:] = 40.0  # padding columns hold garbage that must not enter the softmax
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(2 * LOCAL_V, H, generator=gen, dtype=torch.float64) / H**0.5 * 3
    targets = torch.randint(0, vocab_size, (N,), generator=gen)
    targets[[4, 9]] = -100
    grad_lp = torch.randn(N, generator=gen, dtype=torch.float64)
    grad_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return logits, hidden, weight, targets, grad_lp, grad_ent


def _check_rank(rank: int, vocab_size: int, impl: str) -> dict[str, float]:
    """Relative errors of this rank's outputs and local gradients against a single-process float64 computation."""
    logits, hidden, weight, targets, grad_lp, grad_ent = _inputs(vocab_size)
    cols = slice(rank * LOCAL_V, (rank + 1) * LOCAL_V)
    group = dist.group.WORLD
    errors = {}

    ref_logits = logits.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64(ref_logits[:, :vocab_size], targets, TEMPERATURE)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent, grad_lp, grad_ent), ref_logits)
    ref_grad[:, vocab_size:] = 0.0
    local = logits[:, cols].float().requires_grad_()
    lp, ent = log_probs_and_entropy(local, targets, TEMPERATURE, tp_group=group, vocab_size=vocab_size,
                                   impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(objective(lp, ent, grad_lp, grad_ent), local)
    errors.update(logits_lp=rel_error(lp, ref_lp), logits_entropy=rel_error(ent, ref_ent),
                  logits_grad=rel_error(grad, ref_grad[:, cols]) if ref_grad[:, cols].abs().max() > 0
                  else float(grad.abs().max()))

    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = log_probs_entropy64((ref_h @ ref_w.T)[:, :vocab_size], targets, TEMPERATURE)
    ref_gh, ref_gw = torch.autograd.grad(objective(ref_lp, ref_ent, grad_lp, grad_ent), (ref_h, ref_w))
    h, w = hidden.float().requires_grad_(), weight[cols].float().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h, w, targets, TEMPERATURE, tp_group=group, vocab_size=vocab_size,
                                          impl=SMALL_BACKENDS[impl])
    gh, gw = torch.autograd.grad(objective(lp, ent, grad_lp, grad_ent), (h, w))
    errors.update(linear_lp=rel_error(lp, ref_lp), linear_entropy=rel_error(ent, ref_ent),
                  linear_grad_hidden=rel_error(gh, ref_gh),
                  linear_grad_weight=rel_error(gw, ref_gw[cols]) if ref_gw[cols].abs().max() > 0
                  else float(gw.abs().max()))
    return errors


def _worker(rank: int, world_size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        return {f"{impl}/vocab{vocab}/{name}": err for impl in SMALL_BACKENDS for vocab in (203, 100)
                for name, err in _check_rank(rank, vocab, impl).items()}
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_matches_single_process_float64():
    per_rank = run_processes(_worker, 2)
    failures = {f"rank{r}/{key}": err for r, errors in enumerate(per_rank) for key, err in errors.items()
                if not err < 1e-5}
    assert not failures, failures
