"""One LoRA adapter beside a Megatron linear layer, split over that layer's tensor-parallel group as Megatron-Bridge
splits it, and the forward hook that adds its output to the layer's.

The layer computes `y = W x` (its bias is added as before); with the adapter, `y + scale * B A x`. Over a group of T
ranks (the TP group; for a routed expert, the expert-TP group), rank k holds:
- column-parallel base (`linear_qkv`, `linear_fc1`: W's output rows split): A's rank rows `A_k` [r/T, in] (its
  output gathered, so every rank has `A x`) and B's output rows `B_k` [out/T, r], like W's; the adapter's output is
  this rank's slice of the layer's output;
- row-parallel base (`linear_proj`, `linear_fc2`: W's input columns split): A's input columns `A_k` [r, in/T]
  (`A x` all-reduced) and B's output rows `B_k` [out/T, r], gathered to the whole output.
Sequence parallelism: the column side gathers the sequence before A, the row side keeps this rank's part of the
sequence after B (the layer reduce-scatters its own output). A routed expert's linears do no communication of their
own (the token dispatcher does it): the column side takes the tokens as they are; the row side returns its B slice
in place, zero elsewhere, so that the dispatcher's sum over the expert-TP ranks adds the whole `B A x` once.
With Transformer Engine's fused `LayerNormColumnParallelLinear` the adapter reads the normalised input (the layer's
own RMSNorm, recomputed here).
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

COLUMN, ROW = "column", "row"


class LoraAdapter(torch.nn.Module):
    """The trainable `lora_A` / `lora_B` shards of one linear layer (see the module docstring) and its forward.

    `group`: the tensor-parallel group the base layer is split over; `expert`: a routed expert's linear (no
    communication of its own); `sequence_parallel`: the base layer's input (column) or output (row) is split along
    the sequence. `enabled` False makes it add nothing (the reference policy: the base with its adapters off)."""

    def __init__(self, kind: str, a_shard: torch.Tensor, b_shard: torch.Tensor, scale: float, group: Any,
                 expert: bool, sequence_parallel: bool, dropout: float = 0.0, dropout_position: str = "pre",
                 expert_parallel: bool = False) -> None:
        super().__init__()
        if kind not in (COLUMN, ROW):
            raise ValueError(f"adapter kind {kind!r}: expected {COLUMN!r} or {ROW!r}")
        self.kind, self.scale, self.group = kind, scale, group
        self.expert, self.sequence_parallel = expert, sequence_parallel
        self.dropout, self.dropout_position = dropout, dropout_position
        self.size, self.rank_in_group = group.size(), group.rank()
        self.lora_A = torch.nn.Parameter(a_shard)
        self.lora_B = torch.nn.Parameter(b_shard)
        for param, dim in ((self.lora_A, 0 if kind == COLUMN else 1), (self.lora_B, 0)):
            # what Megatron's optimizer and DDP read: split over TP (counted on every rank in the gradient norm) and,
            # for an expert under EP, reduced over the expert-data-parallel group
            param.tensor_model_parallel, param.partition_dim, param.partition_stride = True, dim, 1
            param.allreduce = not (expert and expert_parallel)
        self.enabled = True

    def _dropout(self, x: torch.Tensor, split: bool) -> torch.Tensor:
        """Dropout in training; over a tensor split across the group (`split`) each rank draws its own mask from
        Megatron's model-parallel stream, over a replicated one every rank draws the same."""
        if not self.training or self.dropout == 0:
            return x
        if split and self.size > 1:
            from megatron.core.tensor_parallel import get_cuda_rng_tracker

            with get_cuda_rng_tracker().fork():
                return F.dropout(x, self.dropout)
        return F.dropout(x, self.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The adapter's contribution to the base layer's output, given the base layer's input."""
        from megatron.core.tensor_parallel import mappings

        group, pre = self.group, self.dropout_position == "pre"
        if self.kind == COLUMN:
            if self.sequence_parallel:
                x = mappings.gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=True, group=group)
            elif not self.expert:
                x = mappings.copy_to_tensor_model_parallel_region(x, group=group)
            x = self._dropout(x, split=False) if pre else x
            low = mappings.gather_from_tensor_model_parallel_region(F.linear(x, self.lora_A), group=group)
        else:
            x = self._dropout(x, split=True) if pre else x
            low = mappings.reduce_from_tensor_model_parallel_region(F.linear(x, self.lora_A), group=group)
        out = F.linear(mappings.copy_to_tensor_model_parallel_region(low, group=group), self.lora_B)
        if self.kind == ROW:
            if self.expert:  # this rank's slice in place: the dispatcher sums the group's partial outputs
                width = out.shape[-1]
                out = F.pad(out, (self.rank_in_group * width, (self.size - 1 - self.rank_in_group) * width))
            else:
                out = mappings.gather_from_tensor_model_parallel_region(out, group=group)
                if self.sequence_parallel:
                    out = mappings.scatter_to_sequence_parallel_region(out, group=group)
        out = out if pre else self._dropout(out, split=self.kind == COLUMN or self.sequence_parallel or self.expert)
        return out * self.scale

    def _gathered(self, shard: torch.Tensor, dim: int) -> torch.Tensor:
        if self.size == 1:
            return shard.detach()
        import torch.distributed as dist

        pieces = [torch.empty_like(shard) for _ in range(self.size)]
        dist.all_gather(pieces, shard.detach().contiguous(), group=self.group)
        return torch.cat(pieces, dim=dim)

    def factors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole A [rank, in] and B [out, rank], in the base layer's Megatron layout (B's rows as the gathered
        weight's). Collective over the group."""
        return self._gathered(self.lora_A, 0 if self.kind == COLUMN else 1), self._gathered(self.lora_B, 0)

    @torch.no_grad()
    def merged_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `W + scale * B A` (W: the base layer's weight shard), in W's dtype, computed in
        float32. Collective over the group (A or B is gathered)."""
        if self.kind == COLUMN:
            delta = self.lora_B.detach().float() @ self._gathered(self.lora_A, 0).float()
        else:
            delta = self._gathered(self.lora_B, 0).float() @ self.lora_A.detach().float()
        return (weight.detach().float() + self.scale * delta).to(weight.dtype)


def _rms_normed(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input a fused layernorm-linear (Transformer Engine) multiplies: its RMSNorm of `x`."""
    config = module.config
    weight = module.layer_norm_weight + (1 if config.layernorm_zero_centered_gamma else 0)
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + config.layernorm_epsilon)).to(x.dtype) * weight


def _add_adapter_output(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    """Forward hook of an adapted linear: `(y, bias)` -> `(y + adapter(x), bias)`."""
    adapter: LoraAdapter = module.lora_adapter
    if not adapter.enabled:
        return output
    x = args[0] if args else kwargs["input_"]
    if hasattr(module, "layer_norm_weight"):
        x = _rms_normed(module, x)
    if isinstance(output, tuple):
        return (output[0] + adapter(x).to(output[0].dtype), *output[1:])
    return output + adapter(x).to(output.dtype)


def attach(module: torch.nn.Module, adapter: LoraAdapter) -> None:
    """Put `adapter` beside the linear `module` (as its submodule `lora_adapter`, so the base's own parameter names
    do not change) and add its output to the module's from now on; the base weight learns where its adapter is
    (`weight.lora_adapter`), for the merge."""
    if hasattr(module, "lora_adapter"):
        raise ValueError(f"{type(module).__name__} already has a LoRA adapter")
    module.lora_adapter = adapter
    module.weight.lora_adapter = adapter
    module.register_forward_hook(_add_adapter_output, with_kwargs=True)


def adapters_of(model: torch.nn.Module) -> list[LoraAdapter]:
    return [module for module in model.modules() if isinstance(module, LoraAdapter)]


@contextlib.contextmanager
def adapters_disabled(model: torch.nn.Module):
    """Within the block `model` computes as its base (every adapter adds nothing): the reference policy of a LoRA
    actor, without a second copy of the weights."""
    adapters = adapters_of(model)
    states = [adapter.enabled for adapter in adapters]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter, state in zip(adapters, states):
            adapter.enabled = state
