"""The log-prob kernels at k ids per token (top-k distillation: the student's log-probs at the teacher's ids) equal the
plain materialised-logits path in values and gradients, on every backend (Triton interpreted), with ignored ids, a
token without any id, temperature != 1 and a padded vocabulary; with one id they equal the one-target kernel; and the
top-k ids equal `torch.topk`. Tensor parallelism (two gloo processes, each half of a padded vocabulary) in one spawn.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from kernel_test_utils import SMALL_BACKENDS, rel_error

from megatron_cpo.kernels import linear_log_probs_and_entropy, linear_top_k, log_probs_and_entropy, logits_top_k
from tests.multiprocess import run_processes

N, V, H, K = 23, 203, 40, 7
PADDED_V = 208
TOL = 1e-5


def _inputs(seed: int, vocab: int = V, padded: int = PADDED_V):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(N, padded, generator=gen, dtype=torch.float64) * 3
    logits[:, vocab:] = 50.0  # padding columns: garbage the softmax must leave out
    hidden = torch.randn(N, H, generator=gen, dtype=torch.float64)
    weight = torch.randn(padded, H, generator=gen, dtype=torch.float64) / H**0.5 * 3
    ids = torch.stack([torch.randperm(vocab, generator=gen)[:K] for _ in range(N)])
    ids[3, 2] = ids[5, 0] = -100
    ids[8] = -100  # a token without any id: log-probs 0, entropy 0, no gradient
    grad_ids = torch.randn(N, K, generator=gen, dtype=torch.float64)
    grad_ent = torch.randn(N, generator=gen, dtype=torch.float64)
    return logits, hidden, weight, ids, grad_ids, grad_ent


def reference(logits: torch.Tensor, ids: torch.Tensor, temperature: float, vocab: int):
    """Float64 log-softmax over the real vocabulary, gathered at the ids; 0 where ignored (entropy 0 for a token with
    no id)."""
    log_p = torch.log_softmax(logits[..., :vocab].double() / temperature, dim=-1)
    ignored = ids == -100
    picked = log_p.gather(-1, ids.masked_fill(ignored, 0)).masked_fill(ignored, 0.0)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return picked, entropy.masked_fill(ignored.all(-1), 0.0)


def objective(log_probs, entropy, grad_ids, grad_ent):
    return (log_probs.double() * grad_ids).sum() + (entropy.double() * grad_ent).sum()


@pytest.mark.parametrize("impl", SMALL_BACKENDS)
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_k_ids_equal_the_plain_logits_path_in_values_and_gradients(impl, temperature):
    logits, hidden, weight, ids, grad_ids, grad_ent = _inputs(0)
    ref = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref, ids, temperature, V)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent, grad_ids, grad_ent), ref)
    x = logits.float().requires_grad_()
    lp, ent = log_probs_and_entropy(x, ids, temperature, vocab_size=V, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(objective(lp, ent, grad_ids, grad_ent), x)
    assert lp.shape == (N, K) and ent.shape == (N,)
    assert max(rel_error(lp, ref_lp), rel_error(ent, ref_ent), rel_error(grad, ref_grad)) < TOL
    assert not grad[8].any() and not lp[8].any() and ent[8] == 0

    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_h @ ref_w.T, ids, temperature, V)
    ref_gh, ref_gw = torch.autograd.grad(objective(ref_lp, ref_ent, grad_ids, grad_ent), (ref_h, ref_w))
    h, w = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h.unsqueeze(0), w, ids.unsqueeze(0), temperature, vocab_size=V,
                                           impl=SMALL_BACKENDS[impl])
    gh, gw = torch.autograd.grad(objective(lp[0], ent[0], grad_ids, grad_ent), (h, w))
    assert lp.shape == (1, N, K) and ent.shape == (1, N)
    errors = [rel_error(lp[0], ref_lp), rel_error(ent[0], ref_ent), rel_error(gh, ref_gh), rel_error(gw, ref_gw)]
    assert max(errors) < TOL, errors
    assert not gw[V:].any()  # padded rows get no gradient


def test_one_id_per_token_equals_the_one_target_kernel():
    logits, hidden, weight, ids, _, _ = _inputs(1)
    one = ids[:, :1]
    lp_k, ent_k = linear_log_probs_and_entropy(hidden.float(), weight.float(), one, vocab_size=V, impl="torch")
    lp_1, ent_1 = linear_log_probs_and_entropy(hidden.float(), weight.float(), one[:, 0], vocab_size=V, impl="torch")
    torch.testing.assert_close(lp_k[:, 0], lp_1, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ent_k, ent_1, rtol=0, atol=0)


def test_top_k_ids_equal_torch_topk_over_the_real_vocabulary():
    logits, hidden, weight, _, _, _ = _inputs(2)
    expected = torch.topk(logits[:, :V], K, dim=-1).indices
    assert torch.equal(logits_top_k(logits.float(), K, vocab_size=V), expected)
    expected = torch.topk((hidden @ weight.T)[:, :V], K, dim=-1).indices
    assert torch.equal(linear_top_k(hidden.float(), weight.float(), K, vocab_size=V), expected)
    with pytest.raises(ValueError, match="k=300 must be in"):
        logits_top_k(logits.float(), 300, vocab_size=V)


# ------------------------------------------------------------------ tensor parallelism


def _tp_errors(rank: int, vocab: int, impl: str) -> dict[str, float]:
    """This rank's errors against one float64 process, on its half of the padded vocabulary."""
    local = PADDED_V // 2
    cols = slice(rank * local, (rank + 1) * local)
    logits, hidden, weight, ids, grad_ids, grad_ent = _inputs(3, vocab, PADDED_V)
    group = dist.group.WORLD
    ref = logits.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref, ids, 0.8, vocab)
    (ref_grad,) = torch.autograd.grad(objective(ref_lp, ref_ent, grad_ids, grad_ent), ref)
    x = logits[:, cols].float().requires_grad_()
    lp, ent = log_probs_and_entropy(x, ids, 0.8, tp_group=group, vocab_size=vocab, impl=SMALL_BACKENDS[impl])
    (grad,) = torch.autograd.grad(objective(lp, ent, grad_ids, grad_ent), x)
    errors = {"logits_lp": rel_error(lp, ref_lp), "logits_entropy": rel_error(ent, ref_ent),
              "logits_grad": rel_error(grad, ref_grad[:, cols]) if ref_grad[:, cols].abs().max() > 0
              else float(grad.abs().max())}
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref_lp, ref_ent = reference(ref_h @ ref_w.T, ids, 0.8, vocab)
    ref_gh, ref_gw = torch.autograd.grad(objective(ref_lp, ref_ent, grad_ids, grad_ent), (ref_h, ref_w))
    h, w = hidden.float().requires_grad_(), weight[cols].float().requires_grad_()
    lp, ent = linear_log_probs_and_entropy(h, w, ids, 0.8, tp_group=group, vocab_size=vocab,
                                           impl=SMALL_BACKENDS[impl])
    gh, gw = torch.autograd.grad(objective(lp, ent, grad_ids, grad_ent), (h, w))
    errors.update(linear_lp=rel_error(lp, ref_lp), linear_entropy=rel_error(ent, ref_ent),
                  linear_grad_hidden=rel_error(gh, ref_gh),
                  linear_grad_weight=rel_error(gw, ref_gw[cols]) if ref_gw[cols].abs().max() > 0
                  else float(gw.abs().max()))
    expected_ids = torch.topk(logits[:, :vocab], K, dim=-1).indices
    errors["logits_top_k"] = float(not torch.equal(logits_top_k(logits[:, cols].float(), K, group, vocab),
                                                   expected_ids))
    expected_ids = torch.topk((hidden @ weight.T)[:, :vocab], K, dim=-1).indices
    errors["linear_top_k"] = float(not torch.equal(linear_top_k(hidden.float(), weight[cols].float(), K, group,
                                                                vocab), expected_ids))
    return errors


def _worker(rank: int, world_size: int) -> dict[str, float]:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:  # vocabulary 203: rank 1 holds 5 padding columns; 100: rank 1 holds only padding
        return {f"{impl}/vocab{vocab}/{name}": err for impl in SMALL_BACKENDS for vocab in (203, 100)
                for name, err in _tp_errors(rank, vocab, impl).items()}
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_k_ids_and_top_k_match_one_float64_process():
    per_rank = run_processes(_worker, 2)
    failures = {f"rank{r}/{key}": err for r, errors in enumerate(per_rank) for key, err in errors.items()
                if not err < TOL}
    assert not failures, failures
