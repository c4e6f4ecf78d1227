"""Hugging Face <-> Megatron-Core weight mapping for the Qwen2/Llama families, with TP and PP.

One table (`LAYER_MAPPINGS` plus the three model-level entries) says which HF tensors make which Megatron parameter and
how that parameter is split over tensor-parallel ranks. Loading reads from safetensors only the tensors this rank's
stage needs; exporting (`iter_hf_weights`) gathers one parameter at a time over the TP group and yields HF-named full
tensors, so peak extra memory is one layer's largest tensor. The rollout weight sync streams the same iterator.

Megatron layouts that differ from HF:
- `linear_qkv` holds q, k and v grouped by KV head: for each query group, its query heads then its key then its value
  head. TP ranks own contiguous query groups.
- `linear_fc1` holds [gate; up]; under TP each rank holds [its gate slice; its up slice].
- The vocabulary (embedding, output layer) is padded to a multiple of the TP size; HF tensors carry the real size.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from megatron_cpo.models.builder import head_dim_of, unwrap_model


@dataclass(frozen=True)
class Shape:
    """The sizes the split/merge functions need."""

    tp_size: int
    num_query_groups: int
    heads_per_group: int
    head_dim: int
    hf_vocab_size: int
    padded_vocab_size: int


def _shape(model: Any, hf_config: Any) -> Shape:
    from megatron.core import parallel_state

    return Shape(tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                 num_query_groups=hf_config.num_key_value_heads,
                 heads_per_group=hf_config.num_attention_heads // hf_config.num_key_value_heads,
                 head_dim=head_dim_of(hf_config),
                 hf_vocab_size=hf_config.vocab_size,
                 padded_vocab_size=model.padded_vocab_size)


def _merge_qkv(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    q, k, v = hf
    rest = q.shape[1:]
    groups = [q.reshape(s.num_query_groups, s.heads_per_group * s.head_dim, *rest),
              k.reshape(s.num_query_groups, s.head_dim, *rest),
              v.reshape(s.num_query_groups, s.head_dim, *rest)]
    return torch.cat(groups, dim=1).reshape(-1, *rest)


def _split_qkv(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    rest = full.shape[1:]
    grouped = full.reshape(s.num_query_groups, (s.heads_per_group + 2) * s.head_dim, *rest)
    q, k, v = grouped.split([s.heads_per_group * s.head_dim, s.head_dim, s.head_dim], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def _merge_gated(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    gate, up = (t.chunk(s.tp_size, dim=0) for t in hf)
    return torch.cat([torch.cat(pair, dim=0) for pair in zip(gate, up)], dim=0)


def _split_gated(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    halves = [shard.chunk(2, dim=0) for shard in full.chunk(s.tp_size, dim=0)]
    return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]


def _pad_vocab(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    (table,) = hf
    padding = table.new_zeros(s.padded_vocab_size - table.shape[0], *table.shape[1:])
    return torch.cat([table, padding], dim=0)


def _trim_vocab(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    return [full[: s.hf_vocab_size].contiguous()]


def _single(hf: list[torch.Tensor], s: Shape) -> torch.Tensor:
    return hf[0]


def _as_list(full: torch.Tensor, s: Shape) -> list[torch.Tensor]:
    return [full]


@dataclass(frozen=True)
class Mapping:
    """HF tensors <-> one Megatron parameter.

    `merge` turns the HF tensors into the full (unsplit) Megatron tensor and `split` back; `tp_dim` is the dimension
    TP ranks split the full tensor along (None: replicated). `megatron_names` lists the parameter's name in the local
    spec first and in the Transformer Engine spec (fused norms) second.
    """

    hf_names: tuple[str, ...]
    megatron_names: tuple[str, ...]
    tp_dim: int | None
    merge: Callable[[list[torch.Tensor], Shape], torch.Tensor] = _single
    split: Callable[[torch.Tensor, Shape], list[torch.Tensor]] = _as_list
    exported: bool = True


_ATTN = "self_attn."
LAYER_MAPPINGS = (
    Mapping(("input_layernorm.weight",),
            ("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight"), None),
    Mapping(tuple(f"{_ATTN}{p}_proj.weight" for p in "qkv"), ("self_attention.linear_qkv.weight",), 0,
            _merge_qkv, _split_qkv),
    Mapping(tuple(f"{_ATTN}{p}_proj.bias" for p in "qkv"), ("self_attention.linear_qkv.bias",), 0,
            _merge_qkv, _split_qkv),
    Mapping((f"{_ATTN}o_proj.weight",), ("self_attention.linear_proj.weight",), 1),
    Mapping((f"{_ATTN}o_proj.bias",), ("self_attention.linear_proj.bias",), None),  # added once, after the TP reduce
    Mapping(("post_attention_layernorm.weight",),
            ("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"), None),
    Mapping(("mlp.gate_proj.weight", "mlp.up_proj.weight"), ("mlp.linear_fc1.weight",), 0,
            _merge_gated, _split_gated),
    Mapping(("mlp.gate_proj.bias", "mlp.up_proj.bias"), ("mlp.linear_fc1.bias",), 0, _merge_gated, _split_gated),
    Mapping(("mlp.down_proj.weight",), ("mlp.linear_fc2.weight",), 1),
    Mapping(("mlp.down_proj.bias",), ("mlp.linear_fc2.bias",), None),
)
# Buffers some checkpoints carry that transformers recomputes from the config and ignores when loading.
IGNORED_HF_SUFFIXES = ("rotary_emb.inv_freq",)
EMBEDDING = Mapping(("model.embed_tokens.weight",), ("embedding.word_embeddings.weight",), 0, _pad_vocab, _trim_vocab)
FINAL_NORM = Mapping(("model.norm.weight",), ("decoder.final_layernorm.weight",), None)
LM_HEAD = Mapping(("lm_head.weight",), ("output_layer.weight",), 0, _pad_vocab, _trim_vocab)
# With tied embeddings and PP > 1 the last stage keeps its own copy of the embedding as the output layer.
TIED_LM_HEAD = Mapping(EMBEDDING.hf_names, LM_HEAD.megatron_names, 0, _pad_vocab, _trim_vocab, exported=False)


def _bound(mapping: Mapping, module: torch.nn.Module) -> tuple[str, torch.nn.Parameter] | None:
    """The (name, parameter) of `module` this mapping fills, or None when the module has no such parameter."""
    params = dict(module.named_parameters())
    for name in mapping.megatron_names:
        if name in params:
            return name, params[name]
    return None


def _model_entries(model: Any, hf_config: Any) -> Iterator[tuple[Mapping, str, str, torch.nn.Parameter]]:
    """(mapping, HF name prefix, Megatron name, parameter) for every mapped parameter of this rank, in HF order.

    With tied embeddings the last stage's output layer is filled from (but never exported as) the HF embedding.
    """
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    if model.pre_process:
        yield (EMBEDDING, "", *_bound(EMBEDDING, model))
    for local_index, layer in enumerate(model.decoder.layers):
        hf_prefix = f"model.layers.{layer.layer_number - 1}."
        for mapping in LAYER_MAPPINGS:
            bound = _bound(mapping, layer)
            if bound is not None:
                name, param = bound
                yield mapping, hf_prefix, f"decoder.layers.{local_index}.{name}", param
    if model.post_process:
        yield (FINAL_NORM, "", *_bound(FINAL_NORM, model))
        if not tied:
            yield (LM_HEAD, "", *_bound(LM_HEAD, model))
        elif not model.pre_process:
            yield (TIED_LM_HEAD, "", *_bound(TIED_LM_HEAD, model))


class SafetensorsReader:
    """Reads named tensors from a single or sharded (`model.safetensors.index.json`) safetensors checkpoint."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            self.files = json.loads(index.read_text())["weight_map"]
        elif (self.dir / "model.safetensors").is_file():
            from safetensors import safe_open

            with safe_open(self.dir / "model.safetensors", framework="pt") as f:
                self.files = {name: "model.safetensors" for name in f.keys()}
        else:
            raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(self.dir)!r}; "
                                    f"save the model with save_pretrained(..., safe_serialization=True)")
        self._open: dict[str, Any] = {}

    def get(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        if name not in self.files:
            raise KeyError(f"tensor {name!r} is missing from the checkpoint in {str(self.dir)!r}")
        file = self.files[name]
        if file not in self._open:
            path = self.dir / file
            if not path.is_file():
                raise FileNotFoundError(f"checkpoint shard {str(path)!r} listed in the index is missing")
            self._open[file] = safe_open(path, framework="pt")
        return self._open[file].get_tensor(name)


def _shard(full: torch.Tensor, mapping: Mapping, tp_rank: int, tp_size: int) -> torch.Tensor:
    if mapping.tp_dim is None:
        return full
    return full.chunk(tp_size, dim=mapping.tp_dim)[tp_rank]


@torch.no_grad()
def load_hf_weights(model: Any, hf_dir: str | Path) -> None:
    """Fill this rank's slice of `model` (from `build_gpt_model`, wrapped or not) with the HF weights in `hf_dir`.

    Every rank reads only the tensors its PP stage owns and keeps only its TP slice. Raises if a tensor is missing,
    its shape does not match the config the model was built from, or a tensor in the files is used by no rank (an
    option of the config the model does not implement, or a config that does not match the weights). Collective over
    all ranks (they share which tensors they used).
    """
    from megatron.core import parallel_state

    model = unwrap_model(model)
    hf_config = model.hf_config
    shape = _shape(model, hf_config)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    reader = SafetensorsReader(hf_dir)
    loaded, used = set(), set()
    for mapping, hf_prefix, name, param in _model_entries(model, hf_config):
        hf_names = [hf_prefix + n for n in mapping.hf_names]
        full = mapping.merge([reader.get(n) for n in hf_names], shape)
        used.update(hf_names)
        shard = _shard(full, mapping, tp_rank, shape.tp_size)
        if shard.shape != param.shape:
            raise ValueError(f"{hf_names} in {str(hf_dir)!r} give shape "
                             f"{tuple(shard.shape)} for Megatron parameter {name!r} of shape {tuple(param.shape)}; "
                             f"the checkpoint does not match its config.json")
        param.copy_(shard)
        loaded.add(name)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise RuntimeError(f"no HF weights were mapped to Megatron parameters {missing}")
    _check_every_tensor_used(model, reader, used)


def _check_every_tensor_used(model: Any, reader: "SafetensorsReader", used: set[str]) -> None:
    """Raise naming the HF tensors no rank loaded; a tied checkpoint's lm_head.weight counts if it equals the
    embedding (transformers ignores it then, and so do we)."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sorted(used))
    left_over = set(reader.files) - set().union(*map(set, per_rank))
    left_over = {n for n in left_over if not n.endswith(IGNORED_HF_SUFFIXES)}
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    if tied and LM_HEAD.hf_names[0] in left_over:
        if torch.equal(reader.get(LM_HEAD.hf_names[0]), reader.get(EMBEDDING.hf_names[0])):
            left_over.discard(LM_HEAD.hf_names[0])
    if left_over:
        raise ValueError(f"{len(left_over)} tensor(s) in {str(reader.dir)!r} are not used by the model built from its "
                         f"config.json: {sorted(left_over)[:8]}{' ...' if len(left_over) > 8 else ''}; the config "
                         f"does not describe these weights (e.g. a bias flag or tie_word_embeddings is wrong)")


@torch.no_grad()
def iter_hf_weights(model: Any, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's weights as HF-named full tensors, one parameter (hence at most one layer) at a time.

    Collective: every rank of the model-parallel group must iterate it to the end, in step. Tensors are yielded on TP
    rank 0 of each PP stage for the layers that stage owns (the embedding on the first stage, the final norm and
    untied lm_head on the last); other TP ranks yield nothing. `model` may be wrapped (DDP, Float16Module).
    Yielded tensors are on the model's device and may alias its parameters: copy them before changing them.
    """
    from megatron.core import parallel_state

    model = unwrap_model(model)
    shape = _shape(model, hf_config)
    tp_group = parallel_state.get_tensor_model_parallel_group()
    is_tp_leader = parallel_state.get_tensor_model_parallel_rank() == 0
    tp_leader = parallel_state.get_tensor_model_parallel_src_rank()
    for mapping, hf_prefix, _, param in _model_entries(model, hf_config):
        if not mapping.exported:
            continue
        shard = param.detach()
        if mapping.tp_dim is not None and shape.tp_size > 1:
            pieces = [torch.empty_like(shard) for _ in range(shape.tp_size)] if is_tp_leader else None
            dist.gather(shard.contiguous(), pieces, dst=tp_leader, group=tp_group)
            full = torch.cat(pieces, dim=mapping.tp_dim) if is_tp_leader else None
            del pieces
        else:
            full = shard
        if is_tp_leader:
            yield from zip((hf_prefix + n for n in mapping.hf_names), mapping.split(full, shape))
