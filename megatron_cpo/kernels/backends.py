"""Backends that compute one rank's softmax statistics and logit gradients: chunked torch and Triton.

Both work on one rank's vocabulary slice and never hold float32 logits for more than a bounded tile; the
tensor-parallel reduction and the autograd wiring are shared (``softmax_stats.finalize``, ``log_probs.py``). A backend
is selected by name through ``BACKENDS`` or passed as an instance (to change tile sizes, as the tests do).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Protocol

import torch
import triton

from megatron_cpo.kernels import triton_kernels
from megatron_cpo.kernels.softmax_stats import SoftmaxStats, combine_partials, empty_stats, grad_of_z, tile_stats


@dataclass(frozen=True)
class RowGrads:
    """What backward needs per token (float32): targets local to the slice, the softmax's max and log-sum-exp
    (``logsumexp(z) = max + log_sum_exp``), entropy, and the incoming gradients."""

    local_targets: torch.Tensor
    max: torch.Tensor
    log_sum_exp: torch.Tensor
    entropy: torch.Tensor
    grad_log_probs: torch.Tensor
    grad_entropy: torch.Tensor

    def rows(self, begin: int, end: int) -> RowGrads:
        return RowGrads(*(t[begin:end] for t in (self.local_targets, self.max, self.log_sum_exp, self.entropy,
                                                   self.grad_log_probs, self.grad_entropy)))


class KernelBackend(Protocol):
    """What ``log_probs.py`` needs from a backend, for one rank's vocabulary slice (``n_valid`` real columns)."""

    def logits_stats(self, logits: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats: ...

    def logits_grad(self, logits: torch.Tensor, row_grads: RowGrads, inv_temp: float, n_valid: int) -> torch.Tensor: ...

    def linear_stats(self, hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats: ...

    def linear_grad(self, hidden: torch.Tensor, weight: torch.Tensor, row_grads: RowGrads, inv_temp: float,
                    n_valid: int) -> tuple[torch.Tensor, torch.Tensor]: ...


def _chunks(total: int, size: int) -> list[tuple[int, int]]:
    return [(begin, min(begin + size, total)) for begin in range(0, total, size)]


@dataclass(frozen=True)
class TorchChunkedBackend:
    """Plain torch over bounded tiles: ``tile_elements`` float32 values per tile (64 MiB by default).

    The CPU path for real runs and a reference implementation on any device.
    """

    tile_elements: int = 1 << 24
    vocab_tile: int = 8192

    def _token_chunk(self, width: int) -> int:
        return max(1, self.tile_elements // max(1, width))

    def logits_stats(self, logits: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats:
        if n_valid == 0:
            return empty_stats(logits.shape[0], logits.device)
        parts = [tile_stats(logits[b:e, :n_valid].float() * inv_temp, local_targets[b:e])
                 for b, e in _chunks(logits.shape[0], self._token_chunk(n_valid))]
        return SoftmaxStats(*(torch.cat(column) for column in zip(*parts)))

    def logits_grad(self, logits: torch.Tensor, row_grads: RowGrads, inv_temp: float, n_valid: int) -> torch.Tensor:
        grad = torch.zeros_like(logits)
        if n_valid == 0:
            return grad
        for b, e in _chunks(logits.shape[0], self._token_chunk(n_valid)):
            r = row_grads.rows(b, e)
            z = logits[b:e, :n_valid].float() * inv_temp
            grad[b:e, :n_valid] = grad_of_z(z, r.local_targets, r.max, r.log_sum_exp, r.entropy, r.grad_log_probs,
                                            r.grad_entropy).mul_(inv_temp)
        return grad

    def linear_stats(self, hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats:
        if n_valid == 0:
            return empty_stats(hidden.shape[0], hidden.device)
        vocab_tile = min(self.vocab_tile, n_valid)
        per_chunk = []
        for b, e in _chunks(hidden.shape[0], self._token_chunk(vocab_tile)):
            h = hidden[b:e].float()
            parts = [tile_stats((h @ weight[vb:ve].float().T).mul_(inv_temp), local_targets[b:e] - vb)
                     for vb, ve in _chunks(n_valid, vocab_tile)]
            per_chunk.append(combine_partials(SoftmaxStats(*(torch.stack(column) for column in zip(*parts)))))
        return SoftmaxStats(*(torch.cat(column) for column in zip(*per_chunk)))

    def linear_grad(self, hidden: torch.Tensor, weight: torch.Tensor, row_grads: RowGrads, inv_temp: float,
                    n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        grad_hidden = torch.zeros_like(hidden)
        grad_weight = torch.zeros_like(weight)
        vocab_tile = min(self.vocab_tile, max(n_valid, 1))
        for b, e in _chunks(hidden.shape[0], self._token_chunk(vocab_tile)):
            r = row_grads.rows(b, e)
            h = hidden[b:e].float()
            grad_h = torch.zeros_like(h)
            for vb, ve in _chunks(n_valid, vocab_tile):
                w = weight[vb:ve].float()
                grad_z = grad_of_z((h @ w.T).mul_(inv_temp), r.local_targets - vb, r.max, r.log_sum_exp, r.entropy,
                                   r.grad_log_probs, r.grad_entropy).mul_(inv_temp)
                grad_h += grad_z @ w
                grad_weight[vb:ve] += (grad_z.T @ h).to(weight.dtype)
            grad_hidden[b:e] = grad_h.to(hidden.dtype)
        return grad_hidden, grad_weight


@dataclass(frozen=True)
class TritonBackend:
    """Triton kernels (compiled on CUDA, interpreted on CPU when ``TRITON_INTERPRET=1``); the tile sizes and the linear
    backward's ``grad_chunk_bytes`` are its settings (how each kernel tiles: benchmarks/kernels/README.md).
    """

    logits_block_v: int = 4096
    block_n: int = 128
    block_v: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    min_programs: int = 1024
    grad_chunk_bytes: int = 256 << 20

    @staticmethod
    def _check_device(tensor: torch.Tensor) -> None:
        if tensor.device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"impl='triton' got a tensor on {tensor.device}: Triton kernels need CUDA tensors, or "
                             "TRITON_INTERPRET=1 set before triton is imported (tests); use impl='torch' on CPU")

    @staticmethod
    def _check_offsets(name: str, rows: int, row_stride: int) -> None:
        """The linear kernels index ``rows x row_stride`` elements with 32-bit offsets; refuse what would overflow."""
        if rows * row_stride >= 2**31:
            raise ValueError(f"{name} spans {rows} x {row_stride} elements, past the 2^31 the Triton linear kernels "
                             f"can address; split the tokens into smaller micro-batches (or shard the lm-head over "
                             f"more TP ranks), or use impl='torch'")

    def _launch_options(self, tensor: torch.Tensor) -> dict:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages} if tensor.is_cuda else {}

    def logits_stats(self, logits: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats:
        self._check_device(logits)
        out = empty_stats(logits.shape[0], logits.device)
        if logits.shape[0] > 0:
            triton_kernels.logits_stats_kernel[(logits.shape[0],)](
                logits, logits.stride(0), local_targets, *out, n_valid, inv_temp, BLOCK_V=self.logits_block_v)
        return out

    def logits_grad(self, logits: torch.Tensor, row_grads: RowGrads, inv_temp: float, n_valid: int) -> torch.Tensor:
        self._check_device(logits)
        n_rows, n_cols = logits.shape
        grad = torch.empty(n_rows, n_cols, dtype=logits.dtype, device=logits.device)
        if n_rows > 0 and n_cols > 0:
            grid = (n_rows, triton.cdiv(n_cols, self.logits_block_v))
            triton_kernels.logits_grad_kernel[grid](
                logits, grad, logits.stride(0), grad.stride(0), row_grads.local_targets, row_grads.max,
                row_grads.log_sum_exp, row_grads.entropy, row_grads.grad_log_probs, row_grads.grad_entropy, n_valid,
                n_cols, inv_temp, BLOCK_V=self.logits_block_v)
        return grad

    def linear_stats(self, hidden: torch.Tensor, weight: torch.Tensor, local_targets: torch.Tensor, inv_temp: float,
                     n_valid: int) -> SoftmaxStats:
        self._check_device(hidden)
        num_tokens, hidden_size = hidden.shape
        self._check_offsets("hidden", num_tokens, hidden.stride(0))
        self._check_offsets("weight", weight.shape[0], weight.stride(0))
        if n_valid == 0 or num_tokens == 0:
            return empty_stats(num_tokens, hidden.device)
        token_blocks = triton.cdiv(num_tokens, self.block_n)
        vocab_tiles = triton.cdiv(n_valid, self.block_v)
        splits = max(1, min(vocab_tiles, triton.cdiv(self.min_programs, token_blocks)))
        tiles_per_split = triton.cdiv(vocab_tiles, splits)
        splits = triton.cdiv(vocab_tiles, tiles_per_split)
        parts = SoftmaxStats(*(torch.empty(splits, num_tokens, dtype=torch.float32, device=hidden.device)
                               for _ in range(4)))
        triton_kernels.linear_stats_kernel[(token_blocks, splits)](
            hidden, weight, local_targets, *parts, num_tokens, n_valid, hidden_size, hidden.stride(0),
            weight.stride(0), tiles_per_split, inv_temp, BLOCK_N=self.block_n, BLOCK_V=self.block_v,
            BLOCK_K=self.block_k, DOT_FP32=not hidden.is_cuda, **self._launch_options(hidden))
        return combine_partials(parts)

    def linear_grad(self, hidden: torch.Tensor, weight: torch.Tensor, row_grads: RowGrads, inv_temp: float,
                    n_valid: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_device(hidden)
        num_tokens, hidden_size = hidden.shape
        n_cols = weight.shape[0]
        self._check_offsets("weight", n_cols, weight.stride(0))
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight)
        chunk = max(self.block_n, self.grad_chunk_bytes // max(1, n_cols * hidden.element_size()))
        grad_logits = torch.empty(min(chunk, num_tokens), n_cols, dtype=hidden.dtype, device=hidden.device)
        for b, e in _chunks(num_tokens, chunk):
            r = row_grads.rows(b, e)
            h = hidden[b:e]
            g = grad_logits[: e - b]
            grid = (triton.cdiv(e - b, self.block_n), triton.cdiv(n_cols, self.block_v))
            triton_kernels.linear_grad_logits_kernel[grid](
                h, weight, g, r.local_targets, r.max, r.log_sum_exp, r.entropy, r.grad_log_probs, r.grad_entropy, e - b,
                n_valid, n_cols, hidden_size, h.stride(0), weight.stride(0), g.stride(0), inv_temp,
                BLOCK_N=self.block_n, BLOCK_V=self.block_v, BLOCK_K=self.block_k, DOT_FP32=not hidden.is_cuda,
                **self._launch_options(hidden))
            torch.matmul(g, weight, out=grad_hidden[b:e])
            grad_weight.addmm_(g.T, h)
        return grad_hidden, grad_weight


BACKENDS: dict[str, KernelBackend] = {"torch": TorchChunkedBackend(), "triton": TritonBackend()}


def resolve_backend(impl: str | KernelBackend, device: torch.device) -> KernelBackend:
    """``"auto"`` is Triton on CUDA and chunked torch elsewhere; a name from ``BACKENDS``; or a backend instance."""
    if not isinstance(impl, str):
        return impl
    name = ("triton" if device.type == "cuda" else "torch") if impl == "auto" else impl
    if name not in BACKENDS:
        raise ValueError(f"impl={impl!r} is unknown; use 'auto', one of {sorted(BACKENDS)}, or a backend instance")
    return BACKENDS[name]
