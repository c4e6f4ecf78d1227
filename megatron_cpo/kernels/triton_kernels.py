"""Triton kernels: softmax statistics and logit gradients from logits, and from hidden states x lm-head tiles.

Compiled on CUDA; on CPU tensors they run under the Triton interpreter (``TRITON_INTERPRET=1``), which the tests use.
The matmul kernels take ``DOT_FP32``: the interpreter's ``tl.dot`` mishandles bfloat16 operands, so on CPU the tiles are
upcast first (exact: bf16 products are representable in fp32 and both paths accumulate in fp32).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _grad_of_z(z, is_target, z_max, log_sum_exp, entropy, grad_lp, grad_ent):
    """d(g_lp * log p_t + g_H * H) / dz for one tile; the row values broadcast against ``z``."""
    log_p = (z - z_max) - log_sum_exp
    p = tl.exp(log_p)
    return -p * (grad_lp + grad_ent * (log_p + entropy)) + tl.where(is_target, grad_lp, 0.0)


@triton.jit
def logits_stats_kernel(logits_ptr, stride_row, targets_ptr, max_ptr, sum_exp_ptr, sum_exp_shift_ptr, target_z_ptr,
                        n_valid, inv_temp, BLOCK_V: tl.constexpr):
    """One program per token: online max / sum-exp / sum-exp-shift over the row's valid columns, plus the target."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride_row
    run_max = float("-inf")
    sum_exp = 0.0
    sum_exp_shift = 0.0
    for start in range(0, n_valid, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < n_valid
        z = tl.load(base + cols, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        new_max = tl.maximum(run_max, tl.max(z, axis=0))
        scale = tl.exp(run_max - new_max)
        shifted = tl.where(valid, z - new_max, 0.0)
        exp = tl.where(valid, tl.exp(shifted), 0.0)
        carried = scale * (sum_exp_shift + sum_exp * tl.where(sum_exp > 0, run_max - new_max, 0.0))
        sum_exp_shift = carried + tl.sum(exp * shifted, axis=0)
        sum_exp = sum_exp * scale + tl.sum(exp, axis=0)
        run_max = new_max
    target = tl.load(targets_ptr + row)
    held = target >= 0
    target_z = tl.load(base + tl.where(held, target, 0), mask=held, other=0.0).to(tl.float32) * inv_temp
    tl.store(max_ptr + row, run_max)
    tl.store(sum_exp_ptr + row, sum_exp)
    tl.store(sum_exp_shift_ptr + row, sum_exp_shift)
    tl.store(target_z_ptr + row, target_z)


@triton.jit
def logits_grad_kernel(logits_ptr, grad_ptr, stride_row, stride_grad, targets_ptr, max_ptr, lse_ptr, entropy_ptr,
                       grad_lp_ptr, grad_ent_ptr, n_valid, n_cols, inv_temp, BLOCK_V: tl.constexpr):
    """Grid (tokens, column tiles): gradient of the logits tile, written in the logits' dtype (zero on padding).

    ``stride_grad`` is the gradient's own row stride: logits may be a column slice of a wider buffer (row stride >
    ``n_cols``) while the gradient is allocated dense."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < n_valid
    z = tl.load(logits_ptr + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32) * inv_temp
    target = tl.load(targets_ptr + row)
    grad = _grad_of_z(z, cols == target, tl.load(max_ptr + row), tl.load(lse_ptr + row), tl.load(entropy_ptr + row),
                      tl.load(grad_lp_ptr + row), tl.load(grad_ent_ptr + row))
    grad = tl.where(valid, grad * inv_temp, 0.0)
    tl.store(grad_ptr + row * stride_grad + cols, grad.to(grad_ptr.dtype.element_ty), mask=cols < n_cols)


@triton.jit
def _logits_tile(hidden_ptr, weight_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, hidden_size,
                 BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """hidden[rows] @ weight[cols]^T for one [BLOCK_N, BLOCK_V] tile, accumulated in float32."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for k0 in range(0, hidden_size, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < hidden_size
        h = tl.load(hidden_ptr + rows[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        w = tl.load(weight_ptr + cols[:, None] * stride_w + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)
        if DOT_FP32:
            h = h.to(tl.float32)
            w = w.to(tl.float32)
        acc = tl.dot(h, tl.trans(w), acc, input_precision="ieee")
    return acc


@triton.jit
def linear_stats_kernel(hidden_ptr, weight_ptr, targets_ptr, max_ptr, sum_exp_ptr, sum_exp_shift_ptr, target_z_ptr,
                        num_tokens, n_valid, hidden_size, stride_h, stride_w, tiles_per_split, inv_temp,
                        BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid (token blocks, vocab splits): online softmax statistics of hidden @ weight^T over one split's tiles.

    Each program writes partial statistics for its split (row ``split`` of the [splits, tokens] outputs); splitting
    the vocabulary keeps every SM busy when there are few token blocks. The logits never leave registers.
    """
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < num_tokens
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    v_begin = split * tiles_per_split * BLOCK_V
    v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, n_valid)
    run_max = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    sum_exp = tl.zeros((BLOCK_N,), tl.float32)
    sum_exp_shift = tl.zeros((BLOCK_N,), tl.float32)
    target_z = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        acc = _logits_tile(hidden_ptr, weight_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, hidden_size,
                           BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32)
        z = tl.where(col_ok[None, :], acc * inv_temp, float("-inf"))
        new_max = tl.maximum(run_max, tl.max(z, axis=1))
        scale = tl.exp(run_max - new_max)
        shifted = tl.where(col_ok[None, :], z - new_max[:, None], 0.0)
        exp = tl.where(col_ok[None, :], tl.exp(shifted), 0.0)
        carried = scale * (sum_exp_shift + sum_exp * tl.where(sum_exp > 0, run_max - new_max, 0.0))
        sum_exp_shift = carried + tl.sum(exp * shifted, axis=1)
        sum_exp = sum_exp * scale + tl.sum(exp, axis=1)
        target_z += tl.sum(tl.where(cols[None, :] == targets[:, None], z, 0.0), axis=1)
        run_max = new_max
    out = split * num_tokens + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_exp_ptr + out, sum_exp, mask=row_ok)
    tl.store(sum_exp_shift_ptr + out, sum_exp_shift, mask=row_ok)
    tl.store(target_z_ptr + out, target_z, mask=row_ok)


@triton.jit
def linear_grad_logits_kernel(hidden_ptr, weight_ptr, grad_ptr, targets_ptr, max_ptr, lse_ptr, entropy_ptr, grad_lp_ptr,
                              grad_ent_ptr, num_tokens, n_valid, n_cols, hidden_size, stride_h, stride_w, stride_g,
                              inv_temp, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                              DOT_FP32: tl.constexpr):
    """Grid (token blocks, vocab tiles) over one token chunk: recompute the logits tile, write its gradient."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    row_ok = rows < num_tokens
    col_ok = cols < n_valid
    acc = _logits_tile(hidden_ptr, weight_ptr, rows, cols, row_ok, col_ok, stride_h, stride_w, hidden_size,
                       BLOCK_N, BLOCK_V, BLOCK_K, DOT_FP32)
    targets = tl.load(targets_ptr + rows, mask=row_ok, other=-1)
    z_max = tl.load(max_ptr + rows, mask=row_ok, other=0.0)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    entropy = tl.load(entropy_ptr + rows, mask=row_ok, other=0.0)
    grad_lp = tl.load(grad_lp_ptr + rows, mask=row_ok, other=0.0)
    grad_ent = tl.load(grad_ent_ptr + rows, mask=row_ok, other=0.0)
    grad = _grad_of_z(acc * inv_temp, cols[None, :] == targets[:, None], z_max[:, None], lse[:, None], entropy[:, None],
                      grad_lp[:, None], grad_ent[:, None])
    grad = tl.where(row_ok[:, None] & col_ok[None, :], grad * inv_temp, 0.0)
    tl.store(grad_ptr + rows[:, None] * stride_g + cols[None, :], grad.to(grad_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (cols[None, :] < n_cols))
