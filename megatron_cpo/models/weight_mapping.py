"""Hugging Face <-> Megatron-Core weights at any TP/PP/EP/ETP layout, one tensor at a time.

The model's family (models/families/) lists which HF tensors make which Megatron parameter (tensor_rules.py
`Mapping`s). Loading reads from safetensors only the tensors this rank's stage and experts need and keeps only its
TP (for experts: ETP) slice; exporting (`iter_hf_weights`) gathers one parameter at a time (for experts: over ETP, then
over EP) and yields HF-named full tensors, so peak extra memory is one layer's largest tensor (for experts: EP of
them). The rollout weight sync streams the same iterator.
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo.models.builder import head_dim_of, unwrap_model
from megatron_cpo.models.families import family_of
from megatron_cpo.models.tensor_rules import (
    EMBEDDING,
    FINAL_NORM,
    IGNORED_HF_SUFFIXES,
    LM_HEAD,
    TIED_LM_HEAD,
    VALUE_HEAD,
    VALUE_HEAD_BIAS,
    Mapping,
    Shape,
)


@dataclass(frozen=True)
class Entry:
    """One Megatron parameter of this rank with the HF tensors that make it; for an expert, `local_expert` is its
    index on this EP rank, which holds `experts_per_rank` consecutive experts."""

    mapping: Mapping
    hf_prefix: str
    name: str
    param: torch.nn.Parameter
    local_expert: int | None = None
    experts_per_rank: int = 0

    def hf_names(self, ep_rank: int = 0) -> tuple[str, ...]:
        """The HF names of the tensors; for an expert, those of the same local expert on EP rank `ep_rank`."""
        if self.local_expert is None:
            return tuple(self.hf_prefix + n for n in self.mapping.hf_names)
        expert = ep_rank * self.experts_per_rank + self.local_expert
        return tuple(self.hf_prefix + n.format(expert=expert) for n in self.mapping.hf_names)


def _shape(model: Any, hf_config: Any) -> Shape:
    from megatron.core import parallel_state

    return Shape(tp_size=parallel_state.get_tensor_model_parallel_world_size(),
                 num_query_groups=hf_config.num_key_value_heads,
                 heads_per_group=hf_config.num_attention_heads // hf_config.num_key_value_heads,
                 head_dim=head_dim_of(hf_config),
                 hf_vocab_size=hf_config.vocab_size,
                 padded_vocab_size=model.padded_vocab_size)


def _expert_shape(shape: Shape) -> Shape:
    from megatron.core import parallel_state

    return replace(shape, tp_size=parallel_state.get_expert_tensor_parallel_world_size())


def _bound(names: tuple[str, ...], params: dict[str, torch.nn.Parameter]) -> tuple[str, torch.nn.Parameter] | None:
    """The first of `names` that is a parameter (local spec name first, Transformer Engine name second)."""
    for name in names:
        if name in params:
            return name, params[name]
    return None


def _layer_entries(mapping: Mapping, layer: torch.nn.Module, hf_prefix: str, local_prefix: str,
                   params: dict[str, torch.nn.Parameter]) -> Iterator[Entry]:
    """The entries one mapping makes in one layer: one, none (a bias the layer does not have), or one per local
    expert."""
    if not mapping.expert:
        bound = _bound(mapping.megatron_names, params)
        if bound is not None:
            yield Entry(mapping, hf_prefix, local_prefix + bound[0], bound[1])
        return
    experts_per_rank = layer.mlp.experts.num_local_experts
    for local in range(experts_per_rank):
        bound = _bound(tuple(n.format(local=local) for n in mapping.megatron_names), params)
        if bound is not None:
            yield Entry(mapping, hf_prefix, local_prefix + bound[0], bound[1], local, experts_per_rank)


def model_entries(model: Any, hf_config: Any) -> Iterator[Entry]:
    """Every mapped parameter of this rank (model from `build_gpt_model`, unwrapped), in HF order.

    With tied embeddings the last stage's output layer is filled from (but never exported as) the HF embedding. A
    value model's (`build_gpt_model(value_head=True)`) is its scalar head, `score.weight` (and `score.bias`).
    """
    family = family_of(hf_config)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    top = dict(model.named_parameters())
    if model.pre_process:
        yield Entry(EMBEDDING, "", *_bound(EMBEDDING.megatron_names, top))
    for local_index, layer in enumerate(model.decoder.layers):
        global_index = layer.layer_number - 1
        params = dict(layer.named_parameters())
        for mapping in family.layer_rules(hf_config, global_index):
            yield from _layer_entries(mapping, layer, f"model.layers.{global_index}.", f"decoder.layers.{local_index}.",
                                      params)
    if model.post_process:
        yield Entry(FINAL_NORM, "", *_bound(FINAL_NORM.megatron_names, top))
        if getattr(model, "value_head", False):
            for mapping in (VALUE_HEAD, VALUE_HEAD_BIAS):
                bound = _bound(mapping.megatron_names, top)
                if bound is not None:
                    yield Entry(mapping, "", *bound)
        elif not tied:
            yield Entry(LM_HEAD, "", *_bound(LM_HEAD.megatron_names, top))
        elif not model.pre_process:
            yield Entry(TIED_LM_HEAD, "", *_bound(TIED_LM_HEAD.megatron_names, top))


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


def _shard(full: torch.Tensor, mapping: Mapping, rank: int, size: int) -> torch.Tensor:
    if mapping.tp_dim is None:
        return full
    return full.chunk(size, dim=mapping.tp_dim)[rank]


@torch.no_grad()
def load_hf_weights(model: Any, hf_dir: str | Path) -> None:
    """Fill this rank's slice of `model` (from `build_gpt_model`, wrapped or not) with the HF weights in `hf_dir`.

    Every rank reads only the tensors its PP stage (and, for experts, its EP rank) owns and keeps only its TP/ETP
    slice. Raises if a tensor is missing, its shape does not match the config the model was built from, or a tensor in
    the files is used by no rank (an option of the config the model does not implement, or a config that does not
    match the weights). Collective over all ranks (they share which tensors they used).
    """
    from megatron.core import parallel_state

    model = unwrap_model(model)
    hf_config = model.hf_config
    shapes = {False: _shape(model, hf_config)}
    shapes[True] = _expert_shape(shapes[False])
    ranks = {False: parallel_state.get_tensor_model_parallel_rank(),
             True: parallel_state.get_expert_tensor_parallel_rank()}
    ep_rank = parallel_state.get_expert_model_parallel_rank()
    reader = SafetensorsReader(hf_dir)
    loaded, used = set(), set()
    for entry in model_entries(model, hf_config):
        expert = entry.mapping.expert
        hf_names = entry.hf_names(ep_rank)
        if entry.mapping in (VALUE_HEAD, VALUE_HEAD_BIAS) and hf_names[0] not in reader.files:
            loaded.add(entry.name)  # a causal LM starts a value model: its head stays the fresh one (value_head.py)
            continue
        full = entry.mapping.merge([reader.get(n) for n in hf_names], shapes[expert])
        used.update(hf_names)
        shard = _shard(full, entry.mapping, ranks[expert], shapes[expert].tp_size)
        if shard.shape != entry.param.shape:
            raise ValueError(f"{list(hf_names)} in {str(hf_dir)!r} give shape {tuple(shard.shape)} for Megatron "
                             f"parameter {entry.name!r} of shape {tuple(entry.param.shape)}; the checkpoint does not "
                             f"match its config.json")
        entry.param.copy_(shard)
        loaded.add(entry.name)
    missing = [n for n, _ in model.named_parameters() if n not in loaded]
    if missing:
        raise RuntimeError(f"no HF weights were mapped to Megatron parameters {missing}")
    _check_every_tensor_used(model, reader, used)


def _check_every_tensor_used(model: Any, reader: SafetensorsReader, used: set[str]) -> None:
    """Raise naming the HF tensors no rank loaded; a tied checkpoint's lm_head.weight counts if it equals the
    embedding (transformers ignores it then, and so do we)."""
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sorted(used))
    left_over = set(reader.files) - set().union(*map(set, per_rank))
    left_over = {n for n in left_over if not n.endswith(IGNORED_HF_SUFFIXES)}
    tied = bool(getattr(model.hf_config, "tie_word_embeddings", False))
    if getattr(model, "value_head", False):  # a value model started from a causal LM has no use for its lm_head
        left_over.discard(LM_HEAD.hf_names[0])
    elif tied and LM_HEAD.hf_names[0] in left_over:
        if torch.equal(reader.get(LM_HEAD.hf_names[0]), reader.get(EMBEDDING.hf_names[0])):
            left_over.discard(LM_HEAD.hf_names[0])
    if left_over:
        raise ValueError(f"{len(left_over)} tensor(s) in {str(reader.dir)!r} are not used by the model built from its "
                         f"config.json: {sorted(left_over)[:8]}{' ...' if len(left_over) > 8 else ''}; the config "
                         f"does not describe these weights (e.g. a bias flag or tie_word_embeddings is wrong)")


def _gather_to_first(tensor: torch.Tensor, group: Any, size: int) -> list[torch.Tensor] | None:
    """Every rank's `tensor` of `group`, by group rank, on the group's first rank (None elsewhere)."""
    if size == 1:
        return [tensor]
    first = dist.get_global_rank(group, 0)
    pieces = [torch.empty_like(tensor) for _ in range(size)] if dist.get_rank() == first else None
    dist.gather(tensor.contiguous(), pieces, dst=first, group=group)
    return pieces


def _unsplit(shard: torch.Tensor, dim: int | None, group: Any, size: int) -> torch.Tensor | None:
    """The full tensor of a parameter split along `dim` over `group`, on the group's first rank (None elsewhere); a
    replicated one (`dim` None) as it is."""
    if dim is None:
        return shard
    pieces = _gather_to_first(shard, group, size)
    return None if pieces is None else torch.cat(pieces, dim=dim)


@dataclass(frozen=True)
class _ExportRoles:
    """Which gathers this rank of a pipeline stage takes part in, and whether it yields."""

    dense: bool    # in the exporting (first) data- and context-parallel replica: gathers over TP
    experts: bool  # in the first expert-data-parallel replica: gathers experts over ETP, then over EP
    yields: bool   # the stage's exporter: TP rank 0 of the exporting replica (also ETP and EP rank 0)

    @classmethod
    def of_this_rank(cls) -> _ExportRoles:
        from megatron.core import parallel_state as ps

        dense = ps.get_data_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0
        yields = dense and ps.get_tensor_model_parallel_rank() == 0
        experts = ps.get_expert_data_parallel_rank() == 0
        if yields and not (experts and ps.get_expert_tensor_parallel_rank() == 0
                           and ps.get_expert_model_parallel_rank() == 0):
            raise RuntimeError("the rank that exports this pipeline stage is not the first rank of its expert groups; "
                               "this parallel layout orders its ranks in a way the export does not support")
        return cls(dense=dense, experts=experts, yields=yields)


def _with_adapter(param: torch.nn.Parameter) -> torch.Tensor:
    """A weight shard as it is, or with the LoRA adapter on its layer merged in (`W + alpha/rank B A`,
    models/lora/layers.py; collective over the layer's TP or expert-TP group)."""
    adapter = getattr(param, "lora_adapter", None)
    return param.detach() if adapter is None else adapter.merged_weight(param)


@torch.no_grad()
def iter_hf_weights(model: Any, hf_config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's weights as HF-named full tensors, one parameter (hence at most one layer) at a time.

    Collective: every rank of the world must iterate it to the end, in step (ranks outside the exporting replica
    take part only in the expert gathers, and only when experts are split over EP or ETP). Tensors are yielded on
    TP rank 0 of the first data-parallel replica of each PP stage, for the layers that stage owns (the embedding on
    the first stage, the final norm and untied lm_head on the last), with every expert gathered from its EP and ETP
    ranks; other ranks yield nothing. `model` may be wrapped (DDP, Float16Module). Yielded tensors are on the model's
    device and may alias its parameters: copy them before changing them. A layer with a LoRA adapter is yielded
    merged, `W + alpha/rank B A` (what the adapted layer computes).
    """
    from megatron.core import parallel_state as ps

    model = unwrap_model(model)
    shape = _shape(model, hf_config)
    expert_shape = _expert_shape(shape)
    roles = _ExportRoles.of_this_rank()
    for entry in model_entries(model, hf_config):
        if not entry.mapping.exported:
            continue
        dim = entry.mapping.tp_dim
        if not entry.mapping.expert:
            if not roles.dense:
                continue
            full = _unsplit(_with_adapter(entry.param), dim, ps.get_tensor_model_parallel_group(), shape.tp_size)
            if roles.yields:
                yield from zip(entry.hf_names(), entry.mapping.split(full, shape))
            continue
        if not roles.experts or (dim is None and ps.get_expert_tensor_parallel_rank() != 0):
            continue
        full = _unsplit(_with_adapter(entry.param), dim, ps.get_expert_tensor_parallel_group(),
                        expert_shape.tp_size)
        if full is None:  # not ETP rank 0: its EP group holds no full experts
            continue
        experts = _gather_to_first(full, ps.get_expert_model_parallel_group(),
                                   ps.get_expert_model_parallel_world_size())
        if roles.yields:  # EP rank r holds the same local expert of its own range
            for ep_rank, tensor in enumerate(experts):
                yield from zip(entry.hf_names(ep_rank), entry.mapping.split(tensor, expert_shape))
