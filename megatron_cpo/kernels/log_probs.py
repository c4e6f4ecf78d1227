"""Per-token log-probs and entropy from vocab-parallel logits, or fused with the lm-head, with autograd.

Tensor-parallel semantics follow Megatron's vocab-parallel cross entropy: with ``tp_group`` each rank holds the logits
(or the lm-head rows) of its contiguous vocabulary slice ``[rank * V_local, (rank + 1) * V_local)``; ``targets`` are
global token ids; max, sum-exp, the target's logit and ``sum p * z`` are reduced over the group, so every rank gets the
full-vocabulary log-prob and entropy of every token.

Backward:
- ``log_probs_and_entropy``: the gradient of each rank's logits shard is exact locally (it needs only the global
  log-sum-exp and entropy, saved from forward); no communication.
- ``linear_log_probs_and_entropy``: the weight gradient is the local shard's; the hidden gradient is the sum over ranks
  of ``grad_logits_shard @ weight_shard``, so it is all-reduced over ``tp_group`` (what the backward of Megatron's
  ``copy_to_tensor_model_parallel_region`` does for a column-parallel lm-head). ``hidden`` must therefore be the full,
  replicated input of the lm-head (gather sequence-parallel activations first).

``targets`` may also hold k ids per token (``[..., k]``): the log-prob of each id under the full-vocabulary softmax,
as top-k distillation needs the student's log-probs at the teacher's ids. The backend then computes the statistics
without a target and the k logits are a gather-dot (picked.py); the entropy is the token's, as with one target.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_cpo.kernels.backends import KernelBackend, RowGrads, resolve_backend
from megatron_cpo.kernels.picked import (
    add_picked_linear_grads,
    add_picked_logits_grads,
    picked_linear_logits,
    picked_logits,
)
from megatron_cpo.kernels.softmax_stats import VocabShard, finalize

Impl = str | KernelBackend
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_inputs(name: str, tensor: torch.Tensor, targets: torch.Tensor, temperature: float) -> None:
    if tensor.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; use float32, bfloat16 or float16")
    if tensor.shape[:-1] != targets.shape and tensor.shape[:-1] != targets.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must equal {name}'s leading shape "
                         f"{tuple(tensor.shape[:-1])}, or that plus k ids per token")
    if targets.dtype.is_floating_point:
        raise ValueError(f"targets have dtype {targets.dtype}; pass integer token ids")
    if not temperature > 0:
        raise ValueError(f"temperature={temperature} must be > 0")


def _row_grads(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> RowGrads:
    local_targets, z_max, log_sum_exp, entropy, ignored = ctx.saved_tensors[-5:]

    def incoming(grad: torch.Tensor | None) -> torch.Tensor:
        if grad is None:
            return torch.zeros_like(entropy)
        return grad.reshape(-1).float().masked_fill(ignored, 0.0).contiguous()

    return RowGrads(local_targets, z_max, log_sum_exp, entropy, incoming(grad_log_probs), incoming(grad_entropy))


def _outputs(result, ignored: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor]:
    log_probs = result.log_probs.masked_fill(ignored, 0.0).reshape(shape)
    entropy = result.entropy.masked_fill(ignored, 0.0).reshape(shape)
    return log_probs, entropy


class _LogitsLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature, tp_group, ignore_index, vocab_size, backend):
        shape = targets.shape
        logits2d = logits.reshape(-1, logits.shape[-1])
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        flat_targets = targets.reshape(-1)
        shard = VocabShard.of_rank(logits2d.shape[-1], tp_group, vocab_size)
        local_targets = shard.localize(flat_targets, ignore_index)
        inv_temp = 1.0 / float(temperature)
        result = finalize(backend.logits_stats(logits2d, local_targets, inv_temp, shard.n_valid), tp_group)
        ignored = flat_targets == ignore_index
        ctx.save_for_backward(logits2d, local_targets, result.max, result.log_sum_exp, result.entropy, ignored)
        ctx.setup = (backend, inv_temp, shard.n_valid, logits.shape)
        return _outputs(result, ignored, shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        backend, inv_temp, n_valid, logits_shape = ctx.setup
        logits2d = ctx.saved_tensors[0]
        grad = backend.logits_grad(logits2d, _row_grads(ctx, grad_log_probs, grad_entropy), inv_temp, n_valid)
        return grad.reshape(logits_shape), None, None, None, None, None, None


class _LinearLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, tp_group, ignore_index, vocab_size, backend):
        shape = targets.shape
        hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        weight = weight.contiguous()
        flat_targets = targets.reshape(-1)
        shard = VocabShard.of_rank(weight.shape[0], tp_group, vocab_size)
        local_targets = shard.localize(flat_targets, ignore_index)
        inv_temp = 1.0 / float(temperature)
        result = finalize(backend.linear_stats(hidden2d, weight, local_targets, inv_temp, shard.n_valid), tp_group)
        ignored = flat_targets == ignore_index
        ctx.save_for_backward(hidden2d, weight, local_targets, result.max, result.log_sum_exp, result.entropy,
                              ignored)
        ctx.setup = (backend, inv_temp, shard.n_valid, hidden.shape, tp_group)
        return _outputs(result, ignored, shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        backend, inv_temp, n_valid, hidden_shape, tp_group = ctx.setup
        hidden2d, weight = ctx.saved_tensors[:2]
        grad_hidden, grad_weight = backend.linear_grad(hidden2d, weight, _row_grads(ctx, grad_log_probs, grad_entropy),
                                                       inv_temp, n_valid)
        if tp_group is not None:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        return grad_hidden.reshape(hidden_shape), grad_weight, None, None, None, None, None, None


def _ids_setup(ids: torch.Tensor, local_size: int, tp_group, vocab_size, ignore_index: int):
    """The [N, k] ids, this rank's slice, the ids local to it (-1 elsewhere), the ignored ids and the tokens with
    no id at all (their entropy is 0 and gets no gradient)."""
    flat = ids.reshape(-1, ids.shape[-1])
    shard = VocabShard.of_rank(local_size, tp_group, vocab_size)
    ignored = flat == ignore_index
    return shard, shard.localize(flat, ignore_index), ignored, ignored.all(-1)


def _ids_row_grads(ctx, grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None
                   ) -> tuple[RowGrads, torch.Tensor]:
    """The backend's per-token gradients (no target; the k ids' gradients summed) and the ids' own [N, k]."""
    local_ids, z_max, log_sum_exp, entropy, ignored, no_ids = ctx.saved_tensors[-6:]
    grad_ids = (torch.zeros_like(local_ids, dtype=torch.float32) if grad_log_probs is None
                else grad_log_probs.reshape(local_ids.shape).float().masked_fill(ignored, 0.0))
    grad_ent = (torch.zeros_like(entropy) if grad_entropy is None
                else grad_entropy.reshape(-1).float().masked_fill(no_ids, 0.0).contiguous())
    no_target = torch.full_like(z_max, -1, dtype=torch.int64)
    return RowGrads(no_target, z_max, log_sum_exp, entropy, grad_ids.sum(-1).contiguous(), grad_ent), grad_ids


def _ids_outputs(result, ignored: torch.Tensor, no_ids: torch.Tensor, ids_shape: torch.Size
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    return (result.log_probs.masked_fill(ignored, 0.0).reshape(ids_shape),
            result.entropy.masked_fill(no_ids, 0.0).reshape(ids_shape[:-1]))


class _LogitsLogProbsAtIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, ids, temperature, tp_group, ignore_index, vocab_size, backend):
        logits2d = logits.reshape(-1, logits.shape[-1])
        if logits2d.stride(-1) != 1:
            logits2d = logits2d.contiguous()
        shard, local_ids, ignored, no_ids = _ids_setup(ids, logits2d.shape[-1], tp_group, vocab_size, ignore_index)
        inv_temp = 1.0 / float(temperature)
        no_target = torch.full((logits2d.shape[0],), -1, dtype=torch.int64, device=logits.device)
        stats = backend.logits_stats(logits2d, no_target, inv_temp, shard.n_valid)
        result = finalize(stats._replace(target_z=picked_logits(logits2d, local_ids, inv_temp)), tp_group)
        ctx.save_for_backward(logits2d, local_ids, result.max, result.log_sum_exp, result.entropy, ignored, no_ids)
        ctx.setup = (backend, inv_temp, shard.n_valid, logits.shape)
        return _ids_outputs(result, ignored, no_ids, ids.shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        backend, inv_temp, n_valid, logits_shape = ctx.setup
        logits2d, local_ids = ctx.saved_tensors[:2]
        row_grads, grad_ids = _ids_row_grads(ctx, grad_log_probs, grad_entropy)
        grad = backend.logits_grad(logits2d, row_grads, inv_temp, n_valid)
        add_picked_logits_grads(local_ids, grad_ids, inv_temp, grad)
        return grad.reshape(logits_shape), None, None, None, None, None, None


class _LinearLogProbsAtIds(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, temperature, tp_group, ignore_index, vocab_size, backend):
        hidden2d = hidden.reshape(-1, hidden.shape[-1]).contiguous()
        weight = weight.contiguous()
        shard, local_ids, ignored, no_ids = _ids_setup(ids, weight.shape[0], tp_group, vocab_size, ignore_index)
        inv_temp = 1.0 / float(temperature)
        no_target = torch.full((hidden2d.shape[0],), -1, dtype=torch.int64, device=hidden.device)
        stats = backend.linear_stats(hidden2d, weight, no_target, inv_temp, shard.n_valid)
        picked = picked_linear_logits(hidden2d, weight, local_ids, inv_temp)
        result = finalize(stats._replace(target_z=picked), tp_group)
        ctx.save_for_backward(hidden2d, weight, local_ids, result.max, result.log_sum_exp, result.entropy, ignored,
                              no_ids)
        ctx.setup = (backend, inv_temp, shard.n_valid, hidden.shape, tp_group)
        return _ids_outputs(result, ignored, no_ids, ids.shape)

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        backend, inv_temp, n_valid, hidden_shape, tp_group = ctx.setup
        hidden2d, weight, local_ids = ctx.saved_tensors[:3]
        row_grads, grad_ids = _ids_row_grads(ctx, grad_log_probs, grad_entropy)
        grad_hidden, grad_weight = backend.linear_grad(hidden2d, weight, row_grads, inv_temp, n_valid)
        add_picked_linear_grads(hidden2d, weight, local_ids, grad_ids, inv_temp, grad_hidden, grad_weight)
        if tp_group is not None:
            dist.all_reduce(grad_hidden, op=dist.ReduceOp.SUM, group=tp_group)
        return grad_hidden.reshape(hidden_shape), grad_weight, None, None, None, None, None, None


def log_probs_and_entropy(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                         tp_group: dist.ProcessGroup | None = None, ignore_index: int = -100,
                         vocab_size: int | None = None, impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each target token and the entropy of its distribution, float32, from (vocab-parallel) logits.

    Args:
        logits: ``[..., V_local]`` float32/bf16/fp16, this rank's vocabulary slice; never copied to float32 whole.
        targets: ``[...]`` integer global token ids; ``ignore_index`` marks tokens to skip. Or ``[..., k]``: k ids per
            token, each scored (``log_probs`` is then ``[..., k]``; a token whose k ids are all ``ignore_index`` gets
            entropy 0).
        temperature: the softmax is over ``logits / temperature`` (the sampler's temperature).
        tp_group: the tensor-parallel group over which the vocabulary is split (None: ``logits`` hold all of it).
        ignore_index: targets equal to it get log-prob 0, entropy 0 and no gradient.
        vocab_size: the real vocabulary size when the logits carry Megatron's vocabulary padding: columns at global id
            ``>= vocab_size`` are left out of the softmax and get zero gradient. None: every column is real.
        impl: ``"auto"`` (Triton on CUDA, chunked torch otherwise), ``"triton"``, ``"torch"``, or a backend instance.

    Returns:
        ``(log_probs, entropy)``, float32 of shapes ``targets.shape`` and ``logits.shape[:-1]``; both differentiable
        w.r.t. ``logits``.
    """
    _check_inputs("logits", logits, targets, temperature)
    backend = resolve_backend(impl, logits.device)
    function = _LogitsLogProbsAtIds if targets.dim() == logits.dim() else _LogitsLogProbsEntropy
    return function.apply(logits, targets, temperature, tp_group, ignore_index, vocab_size, backend)


def linear_log_probs_and_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                temperature: float = 1.0, tp_group: dist.ProcessGroup | None = None,
                                ignore_index: int = -100, vocab_size: int | None = None,
                                impl: Impl = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs_and_entropy(hidden @ weight.T, ...)`` without ever holding the logits (online softmax over tiles).

    Args:
        hidden: ``[..., H]`` lm-head input, replicated over ``tp_group`` (its gradient is all-reduced there).
        weight: ``[V_local, H]`` this rank's lm-head rows (Megatron's column-parallel output layer weight), same dtype.
        targets, temperature, tp_group, ignore_index, vocab_size, impl: as in ``log_probs_and_entropy``.

    Returns:
        ``(log_probs, entropy)``, float32 of shapes ``targets.shape`` and ``hidden.shape[:-1]``; differentiable
        w.r.t. ``hidden`` and ``weight`` (backward recomputes the logits tile by tile).
    """
    _check_inputs("hidden", hidden, targets, temperature)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1] or weight.dtype != hidden.dtype:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} must be [V_local, {hidden.shape[-1]}] with "
                         f"hidden's dtype {hidden.dtype}")
    backend = resolve_backend(impl, hidden.device)
    function = _LinearLogProbsAtIds if targets.dim() == hidden.dim() else _LinearLogProbsEntropy
    return function.apply(hidden, weight, targets, temperature, tp_group, ignore_index, vocab_size, backend)
