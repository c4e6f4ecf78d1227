"""The actor's core attention without Transformer Engine: torch's fused `scaled_dot_product_attention`.

Megatron-Core's local `DotProductAttention` materialises every row's `[heads, s, s]` scores and keeps the
probabilities for backward; torch's fused attention (flash and memory-efficient kernels on CUDA, a flash kernel on
CPU) computes the same softmax in tiles and never does. `TorchFusedAttention` takes the local one's place in the layer
spec: causal, grouped-query (key/value heads shared, not repeated), Megatron's sliding window, right-padded rows and
packed sequences in THD (`PackedSeqParams`, attention inside each sequence only): torch's variable-length kernel on
CUDA in 16-bit, else one fused call per sequence with the short ones batched together, the fastest on CPU of the ways
measured (benchmarks/attention/README.md).

`attention_backend` (Megatron's and verl's `override_transformer_config.attention_backend`) picks the kind of core
attention (`core_attention_kind`): `auto`, `flash` and `fused` take Transformer Engine's when it is importable
(`auto` lets it choose, the others are its flash / cuDNN kernels) and torch's fused attention otherwise; `unfused` is
Transformer Engine's unfused kernel; `local` is Megatron-Core's `DotProductAttention` (scores materialised) with or
without it.
"""
from __future__ import annotations

import functools
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from megatron_cpo.models.config import ATTENTION_BACKENDS

ATTENTION_KINDS = ("te", "torch", "local")


def core_attention_kind(backend: str, transformer_engine: bool) -> str:
    """Which core attention `backend` means here: `te` (Transformer Engine's), `torch` (`TorchFusedAttention`) or
    `local` (Megatron-Core's `DotProductAttention`)."""
    name = "actor_rollout_ref.actor.megatron.attention_backend"
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"{name}={backend!r} is unknown; choose from {list(ATTENTION_BACKENDS)}")
    if backend == "local":
        return "local"
    if transformer_engine:
        return "te"
    if backend == "unfused":
        raise ValueError(f"{name}=unfused is Transformer Engine's unfused attention, which is not importable here; "
                         "set it to local (Megatron-Core's attention, scores materialised) or auto (torch's fused one)")
    return "torch"


def packing_layout(kind: str) -> str:
    """The packed layout (trainer/batch/packing.py) a core attention of `kind` reads: THD (cumulative sequence
    lengths) for Transformer Engine's and torch's, per-sequence masks over bin-packed rows for the local one."""
    return "rows" if kind == "local" else "thd"


def window_mask(length: int, left: int | None, device: Any = None) -> torch.Tensor:
    """[length, length] bool, True where query i may see key j: j <= i and, with a window, i - j <= left."""
    steps = torch.arange(length, device=device)
    distance = steps[:, None] - steps[None, :]
    allowed = distance >= 0
    return allowed & (distance <= left) if left is not None else allowed


def causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
                     window_left: int | None = None, allowed: torch.Tensor | None = None,
                     dropout_p: float = 0.0) -> torch.Tensor:
    """Causal attention of `query` [..., heads, L, d] over `key`/`value` [..., kv_heads, L, d] (kv heads shared by
    heads / kv_heads queries each), within `window_left` keys back when given, and only where `allowed` (broadcast
    to [..., L, L], True = may attend) when given."""
    gqa = query.shape[-3] != key.shape[-3]
    if window_left is None and allowed is None:
        return F.scaled_dot_product_attention(query, key, value, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=gqa)
    mask = window_mask(query.shape[-2], window_left, query.device)
    mask = mask if allowed is None else mask & allowed
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout_p, scale=scale,
                                          enable_gqa=gqa)


SHORT_SEQUENCE = 256
"""THD sequences shorter than this share one fused call as right-padded rows (on CPU a call costs more than padding
them, benchmarks/attention/README.md); longer ones get one call each, exact causal attention without padding."""


def per_sequence_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lengths: list[int],
                           scale: float, window_left: int | None = None, dropout_p: float = 0.0,
                           short: int = SHORT_SEQUENCE) -> torch.Tensor:
    """THD: `query` [T, heads, d], `key`/`value` [T, kv_heads, d] holding sequences of `lengths` tokens end to end;
    each attends causally to itself only: one fused call per sequence of at least `short` tokens, one for all the
    shorter ones together as right-padded rows (their padding comes after every real token, so causal attention never
    reads it). Returns [T, heads, d]."""
    starts = torch.tensor([0, *lengths[:-1]]).cumsum(0).tolist()
    pieces: dict[int, torch.Tensor] = {}
    for index, (start, length) in enumerate(zip(starts, lengths)):
        if length >= short:
            qkv = (tensor[start:start + length][None].transpose(1, 2) for tensor in (query, key, value))
            pieces[index] = causal_attention(*qkv, scale, window_left, dropout_p=dropout_p).transpose(1, 2)[0]
    batched = [index for index, length in enumerate(lengths) if 0 < length < short]
    if batched:
        rows = torch.tensor([lengths[i] for i in batched])
        first, steps = torch.tensor([starts[i] for i in batched])[:, None], torch.arange(int(rows.max()))[None, :]
        gather = torch.where(steps < rows[:, None], first + steps, first).to(query.device)  # padding: a real token
        padded = causal_attention(*(tensor[gather].transpose(1, 2) for tensor in (query, key, value)), scale,
                                  window_left, dropout_p=dropout_p).transpose(1, 2)
        pieces.update({index: padded[row, :lengths[index]] for row, index in enumerate(batched)})
    return torch.cat([pieces[index] for index in sorted(pieces)])


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    """The keyword arguments of torch's `varlen_attn` (CUDA; its causal switch changed across torch versions), empty
    when this torch has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return frozenset(inspect.signature(varlen_attn).parameters)


def varlen_applies(query: torch.Tensor, window_left: int | None) -> bool:
    """Whether torch's variable-length flash kernel can take this THD batch: CUDA, 16-bit, and a torch whose
    `varlen_attn` has the causal (and, for a sliding window, the window) argument."""
    parameters = _varlen_parameters()
    causal = "window_size" in parameters or ("is_causal" in parameters and window_left is None)
    return query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and causal


def varlen_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_length: int, scale: float, window_left: int | None = None) -> torch.Tensor:
    """THD through torch's `varlen_attn` (one kernel for every sequence; see `varlen_applies`). [T, heads, d]."""
    from torch.nn.attention.varlen import varlen_attn

    parameters = _varlen_parameters()
    options: dict[str, Any] = {"scale": scale}
    if "window_size" in parameters:
        options["window_size"] = (-1 if window_left is None else window_left, 0)
    else:
        options["is_causal"] = True
    if key.shape[1] != query.shape[1]:
        if "enable_gqa" in parameters:
            options["enable_gqa"] = True
        else:
            repeats = query.shape[1] // key.shape[1]
            key, value = key.repeat_interleave(repeats, dim=1), value.repeat_interleave(repeats, dim=1)
    cu_seqlens = cu_seqlens.to(device=query.device, dtype=torch.int32)
    return varlen_attn(query, key, value, cu_seqlens, cu_seqlens, max_length, max_length, **options)


class TorchFusedAttention(torch.nn.Module):
    """Megatron's `core_attention` (the local `DotProductAttention`'s constructor and call) on torch's fused
    attention. Inputs `[s, b, heads, d]` (keys/values with the TP rank's query groups) or, with THD packing, `[T,
    heads, d]`; returns `[s, b, heads x d]` (`[T, heads x d]`). `attention_mask` (`[b, 1, s, s]`, True = hidden),
    when given, hides keys on top of the causal (and window) mask."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        from megatron.core.transformer.utils import is_layer_window_attention

        super().__init__()
        if config.context_parallel_size > 1:
            raise ValueError("context parallelism needs Transformer Engine's attention; set "
                             "actor_rollout_ref.actor.megatron.context_parallel_size=1")
        if config.softmax_type != "vanilla":
            raise ValueError(f"softmax_type={config.softmax_type!r} (a softmax offset) is not in torch's fused "
                             "attention; set actor_rollout_ref.actor.megatron.attention_backend=local")
        self.config = config
        self.layer_number = max(1, layer_number)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        windowed = is_layer_window_attention(config.window_size, config.window_attn_skip_freq, self.layer_number)
        self.window_left = int(config.window_size[0]) if windowed else None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, attn_mask_type: Any = None, attention_bias: Any = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        if attention_bias is not None:
            raise ValueError("an attention bias is not supported by torch's fused attention; set "
                             "actor_rollout_ref.actor.megatron.attention_backend=local")
        with self._dropout_rng():
            dropout_p = self.dropout_p if self.training else 0.0
            if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
                return self._thd(query, key, value, packed_seq_params, dropout_p).flatten(1)
            # [s, b, heads, d] -> [b, heads, s, d]
            q, k, v = (tensor.permute(1, 2, 0, 3) for tensor in (query, key, value))
            allowed = ~attention_mask if attention_mask is not None else None
            output = causal_attention(q, k, v, self.scale, self.window_left, allowed, dropout_p)
        return output.permute(2, 0, 1, 3).flatten(2)

    def _thd(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any,
             dropout_p: float) -> torch.Tensor:
        cu_seqlens = params.cu_seqlens_q
        if dropout_p == 0.0 and varlen_applies(query, self.window_left):
            return varlen_attention(query, key, value, cu_seqlens, int(params.max_seqlen_q), self.scale,
                                    self.window_left)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        return per_sequence_attention(query, key, value, lengths, self.scale, self.window_left, dropout_p)

    def _dropout_rng(self) -> Any:
        """Megatron's model-parallel RNG around dropout, as the local attention forks it (no-op without dropout)."""
        import contextlib

        from megatron.core import tensor_parallel

        if self.dropout_p and self.training and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """No parameters, nothing to checkpoint."""
        return {}
