"""Rules that turn Hugging Face tensors into Megatron-Core parameters and back, one `Mapping` per parameter.

A family (models/families/) lists the mappings of its layers; weight_mapping.py applies them. The Megatron layouts
that differ from HF (fused QKV by query group, [gate; up], padded vocabulary, local expert indices):
docs/conversion.md, "Megatron layouts".
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Shape:
    """The sizes the split/merge functions need; `tp_size` is the size of the group the mapping is split over (the
    TP group, or the ETP group for experts)."""

    tp_size: int
    num_query_groups: int
    heads_per_group: int
    head_dim: int
    hf_vocab_size: int
    padded_vocab_size: int


def merge_qkv(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    q, k, v = hf
    rest = q.shape[1:]
    groups = [q.reshape(s.num_query_groups, s.heads_per_group * s.head_dim, *rest),
              k.reshape(s.num_query_groups, s.head_dim, *rest),
              v.reshape(s.num_query_groups, s.head_dim, *rest)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def split_qkv(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    rest = full.shape[1:]
    grouped = full.reshape(s.num_query_groups, (s.heads_per_group + 2) * s.head_dim, *rest)
    q, k, v = grouped.split([s.heads_per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def merge_gated(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    gate, up = (t.chunk(s.tp_size, dim=0) for t in hf)
    return torch.cat([torch.cat(pair, dim=0) for pair in zip(gate, up)], dim=0)


def split_gated(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    halves = [shard.chunk(2, dim=0) for shard in full.chunk(s.tp_size, dim=0)]
    return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


def pad_vocab(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    (table,) = hf
    padding = table.new_zeros(s.padded_vocab_size - table.shape[0], *table.shape[1:])
    return torch.cat([table, padding], dim=0)


def trim_vocab(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    return [full[: s.hf_vocab_size].contiguous()]


def single(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    return hf[0]


def as_list(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    return [full]


@dataclass(frozen=True)
class Mapping:
    """HF tensors <-> one Megatron parameter.

    `merge` turns the HF tensors into the full (unsplit) Megatron tensor and `split` back; `tp_dim` is the dimension
    the TP (for an expert: ETP) ranks split the full tensor along (None: replicated). `megatron_names` lists the
    parameter's name in the local spec first and in the Transformer Engine spec (fused norms, grouped experts)
    second. An `expert` mapping stands for one parameter per local expert (see the module docstring).
    """

    hf_names: tuple[str, ...]
    megatron_names: tuple[str, ...]
    tp_dim: int | None
    merge: Callable[[list[torch.Tensor], Shape], torch.Tensor] = single
    split: Callable[[torch.Tensor, Shape], list[torch.Tensor]] = as_list
    exported: bool = True
    expert: bool = False


def attention_rules(qk_norm: bool = False) -> tuple[Mapping, ...]:
    """Input norm, q/k/v (weights and biases, by KV group), o_proj and, for Qwen3-style attention, the per-head q/k
    RMSNorms."""
    attn = "self_attn."
    rules = (
        Mapping(("input_layernorm.weight",),
                ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), None),
        Mapping(tuple(f"{attn}{p}_proj.weight" for p in "qkv"), ("self_attention.linear_qkv.weight",), 0,
                merge_qkv, split_qkv),
        Mapping(tuple(f"{attn}{p}_proj.bias" for p in "qkv"), ("self_attention.linear_qkv.bias",), 0,
                merge_qkv, split_qkv),
        Mapping((f"{attn}o_proj.weight",), ("self_attention.linear_proj.weight",), 1),
        Mapping((f"{attn}o_proj.bias",), ("self_attention.linear_proj.bias",), None),  # added once, after the reduce
    )
    if qk_norm:
        rules += (Mapping((f"{attn}q_norm.weight",), ("self_attention.q_layernorm.weight",), None),
                  Mapping((f"{attn}k_norm.weight",), ("self_attention.k_layernorm.weight",), None))
    return rules


def dense_mlp_rules(prefix: str = "mlp.", megatron_prefix: str = "mlp.",
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                    expert: bool = False) -> tuple[Mapping, ...]:
    """A SwiGLU MLP: HF `{prefix}{gate,up,down}.weight/.bias` <-> Megatron `{megatron_prefix}linear_fc1/fc2`.

    For experts, `megatron_prefix` carries `{local}` and the Transformer Engine's grouped-expert name
    (`mlp.experts.linear_fc1.weight{local}`) is accepted as the second Megatron name."""
    gate, up, down = names

    def megatron(linear: str, kind: str) -> tuple[str, ...]:
        local = (f"{megatron_prefix}{linear}.{kind}",)
        return local + ((f"mlp.experts.{linear}.{kind}{{local}}",) if expert else ())

    return (
        Mapping((f"{prefix}{gate}.weight", f"{prefix}{up}.weight"), megatron("linear_fc1", "weight"), 0,
                merge_gated, split_gated, expert=expert),
        Mapping((f"{prefix}{gate}.bias", f"{prefix}{up}.bias"), megatron("linear_fc1", "bias"), 0,
                merge_gated, split_gated, expert=expert),
        Mapping((f"{prefix}{down}.weight",), megatron("linear_fc2", "weight"), 1, expert=expert),
        Mapping((f"{prefix}{down}.bias",), megatron("linear_fc2", "bias"), None, expert=expert),
    )


def post_attention_norm_rule() -> Mapping:
    """The norm before the MLP (fused into linear_fc1 in the Transformer Engine spec of a dense layer)."""
    return Mapping(("post_attention_layernorm.weight",),
                   ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), None)


@dataclass(frozen=True)
class ExpertNames:
    """Where a family's MoE block keeps its tensors in the HF checkpoint (as saved on disk, and as vLLM loads them).

    `block`: the layer's MoE module (`mlp.`, Mixtral's `block_sparse_moe.`); `router`: its router weight; `experts`:
    the per-expert prefix with `{expert}`; `projections`: the gate, up and down projection names of an expert;
    `shared_expert` / `shared_expert_gate`: Qwen2-MoE's always-on expert and its sigmoid gate (None: none)."""

    block: str = "mlp."
    router: str = "gate.weight"
    experts: str = "experts.{expert}."
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    shared_expert: str | None = None
    shared_expert_gate: str | None = None


def moe_rules(names: ExpertNames) -> tuple[Mapping, ...]:
    """Router, routed experts (one mapping per projection, expanded per local expert) and the optional shared expert
    with its gate. Megatron: `mlp.router.weight` [E, H], `mlp.experts.local_experts.{l}.linear_fc1/fc2` (local spec)
    or `mlp.experts.linear_fc1.weight{l}` (TE grouped), `mlp.shared_experts.linear_fc1/fc2` and `.gate_weight`."""
    block = names.block
    rules = (Mapping((f"{block}{names.router}",), ("mlp.router.weight",), None),
             *dense_mlp_rules(f"{block}{names.experts}", "mlp.experts.local_experts.{local}.", names.projections,
                              expert=True))
    if names.shared_expert is not None:
        rules += dense_mlp_rules(f"{block}{names.shared_expert}", "mlp.shared_experts.")
    if names.shared_expert_gate is not None:
        rules += (Mapping((f"{block}{names.shared_expert_gate}",), ("mlp.shared_experts.gate_weight",), None),)
    return rules


EMBEDDING = Mapping(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), 0, pad_vocab, trim_vocab)
FINAL_NORM = Mapping(("model.norm.weight",), ("decoder.final_layernorm.weight",), None)
LM_HEAD = Mapping(("lm_head.weight",), ("output_layer.weight",), 0, pad_vocab, trim_vocab)
# With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as the output layer.
TIED_LM_HEAD = Mapping(EMBEDDING.hf_names, LM_HEAD.megatron_names, 0, pad_vocab, trim_vocab, exported=False)
# A value model's scalar head (value_head.py), replicated over TP: transformers' token-classification `score`.
VALUE_HEAD = Mapping(("score.weight",), ("output_layer.weight",), None)
VALUE_HEAD_BIAS = Mapping(("score.bias",), ("output_layer.bias",), None)
# Buffers some checkpoints carry that transformers recomputes from the config and ignores when loading.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
