"""Put LoRA adapters on a built Megatron model (every rank, its own TP slice / PP stage / experts) and freeze the rest.

`apply_lora` runs after the base weights are loaded: it resolves `lora.target_modules` / `exclude_modules` against the
model's layers (targets.py), gives each selected linear of this rank an adapter split as the linear is (layers.py),
initialised from one generator per layer seeded by the layer's canonical name and `seed`, so every layout starts from
the same adapters (A: xavier-normal or kaiming-uniform over the whole [rank, in] matrix, then sliced; B: zero), and
leaves only the adapters (and `keep_trainable` modules, a critic's value head) trainable.
"""
from __future__ import annotations

import math
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.models.builder import unwrap_model
from megatron_cpo.models.config import LoraConfig
from megatron_cpo.models.lora.layers import COLUMN, ROW, LoraAdapter, adapters_of, attach
from megatron_cpo.models.lora.targets import AdaptableLayer, adaptable_layers, layer_named, select_layers
from megatron_cpo.models.weight_mapping import Entry, model_entries


@dataclass(frozen=True)
class AdapterSite:
    """A linear of this rank that can carry an adapter: its weight's `Entry` (weight_mapping.py), its layer's
    canonical name and HF modules, and whether it is a routed expert's."""
    entry: Entry
    layer: AdaptableLayer

    @property
    def kind(self) -> str:
        return COLUMN if self.entry.mapping.tp_dim == 0 else ROW

    @property
    def expert(self) -> bool:
        return self.entry.mapping.expert

    @property
    def module_name(self) -> str:
        return self.entry.name.removesuffix(".weight")


def adapter_sites(model: Any) -> Iterator[AdapterSite]:
    """This rank's adaptable linears (model unwrapped), in HF order."""
    from megatron.core import parallel_state

    ep_rank = parallel_state.get_expert_model_parallel_rank()
    for entry in model_entries(model, model.hf_config):
        megatron = entry.mapping.megatron_names[0]
        if not megatron.endswith(".weight") or megatron.removesuffix(".weight").rsplit(".", 1)[-1] not in (
                "linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"):
            continue
        if entry.mapping.expert and ".local_experts." not in entry.name:
            raise ValueError("LoRA on grouped-GEMM experts (Transformer Engine's TEGroupedMLP) is not built; "
                             "exclude the routed experts (lora.exclude_modules=['*.experts.*']) or build the "
                             "model with moe_grouped_gemm off")
        index = int(entry.hf_prefix.split(".")[2])
        expert = None if entry.local_expert is None else ep_rank * entry.experts_per_rank + entry.local_expert
        yield AdapterSite(entry, layer_named(index, megatron, entry.mapping.hf_names, expert))


def layer_seed(canonical: str, seed: int) -> int:
    """The seed of one layer's adapter initialisation: the same on every rank and at every layout."""
    return (zlib.crc32(canonical.encode()) + 1_000_003 * seed) % (2 ** 63)


def initial_a(rank: int, width: int, method: str, generator: torch.Generator) -> torch.Tensor:
    """A whole [rank, width] A matrix as Megatron-Bridge initialises it: `xavier` (normal) or `kaiming` (uniform,
    a = sqrt(5): PEFT's default)."""
    full = torch.empty(rank, width)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(full, generator=generator)
    return torch.nn.init.kaiming_uniform_(full, a=math.sqrt(5), generator=generator)


def _group_of(expert: bool) -> Any:
    from megatron.core import parallel_state

    return (parallel_state.get_expert_tensor_parallel_group() if expert
            else parallel_state.get_tensor_model_parallel_group())


def _adapter_for(site: AdapterSite, weight: torch.Tensor, lora: LoraConfig, sequence_parallel: bool,
                 expert_parallel: bool, seed: int) -> LoraAdapter:
    group = _group_of(site.expert)
    size, index = group.size(), group.rank()
    rank, where = lora.rank, f"{lora.SECTION}.rank={lora.rank}"
    out_local, in_local = weight.shape
    if site.kind == COLUMN:
        if rank % size:
            raise ValueError(f"{where} does not split over the {size} ranks of {site.layer.canonical}'s tensor-"
                             f"parallel group (an adapter's rank is split as Megatron-Bridge splits it on a column-"
                             f"parallel layer); choose a multiple of {size}")
        full_a = initial_a(rank, in_local, lora.lora_A_init_method,
                           torch.Generator().manual_seed(layer_seed(site.layer.canonical, seed)))
        a_shard = full_a.chunk(size, dim=0)[index]
    else:
        full_a = initial_a(rank, in_local * size, lora.lora_A_init_method,
                           torch.Generator().manual_seed(layer_seed(site.layer.canonical, seed)))
        a_shard = full_a.chunk(size, dim=1)[index]
        if out_local % size:
            raise ValueError(f"{site.layer.canonical}'s output width {out_local} does not split over its "
                             f"{size}-rank tensor-parallel group, which the adapter's B needs; exclude it "
                             f"({lora.SECTION}.exclude_modules) or change the layout")
        out_local //= size
    b_shard = torch.zeros(out_local, rank)
    return LoraAdapter(site.kind, a_shard.to(weight.device, weight.dtype).contiguous(),
                       b_shard.to(weight.device, weight.dtype), lora.scale, group, site.expert,
                       sequence_parallel and not site.expert and size > 1, lora.dropout, lora.dropout_position,
                       expert_parallel)


def apply_lora(model: Any, lora: LoraConfig, seed: int = 0, keep_trainable: tuple[str, ...] = ()) -> int:
    """Adapters on this rank's layers that `lora` selects; every other parameter frozen except those under the
    module names in `keep_trainable`. Returns how many adapters this rank holds; raises (one line) when the
    targets select nothing, a rank does not split, or this pipeline stage gets no adapter."""
    from megatron.core import parallel_state

    gpt = unwrap_model(model)
    selected = {layer.canonical for layer in select_layers(adaptable_layers(gpt.hf_config), lora)}
    expert_parallel = parallel_state.get_expert_model_parallel_world_size() > 1
    gpt.requires_grad_(False)
    count = 0
    for site in adapter_sites(gpt):
        if site.layer.canonical not in selected:
            continue
        module = gpt.get_submodule(site.module_name)
        attach(module, _adapter_for(site, module.weight, lora, gpt.config.sequence_parallel, expert_parallel, seed))
        count += 1
    if count == 0:
        raise ValueError(f"pipeline stage {parallel_state.get_pipeline_model_parallel_rank()} holds none of the "
                         f"layers {lora.SECTION}.target_modules selects; target layers on every stage or lower "
                         "pipeline_model_parallel_size")
    for adapter in adapters_of(gpt):
        adapter.requires_grad_(True)
    for name in keep_trainable:
        if hasattr(gpt, name):
            getattr(gpt, name).requires_grad_(True)
    gpt.lora = lora
    return count


def lora_of(model: Any) -> LoraConfig | None:
    """The adapters' settings of a model `apply_lora` adapted (None: a plain model)."""
    return getattr(unwrap_model(model), "lora", None)


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """What a LoRA model's checkpoint holds: its trainable parameters (the adapters and a critic's value head)."""
    return {name: param.detach() for name, param in unwrap_model(model).named_parameters() if param.requires_grad}


@torch.no_grad()
def load_trainable_state(model: Any, state: dict[str, torch.Tensor], where: str) -> None:
    """Restore `trainable_state`; one-line error when `state` was saved with other adapters (`where` names it)."""
    params = {name: param for name, param in unwrap_model(model).named_parameters() if param.requires_grad}
    missing, unexpected = sorted(set(params) - set(state)), sorted(set(state) - set(params))
    if missing or unexpected:
        what = (f"lacks {missing[:3]}" if missing else "") + (" and " if missing and unexpected else "") + (
            f"holds {unexpected[:3]}, which this run does not train" if unexpected else "")
        raise ValueError(f"{where} {what}: it was written with other LoRA settings (or without LoRA); resume with "
                         "the settings it was written with")
    for name, param in params.items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise ValueError(f"{where} holds {name} of shape {tuple(state[name].shape)}, this run's is "
                             f"{tuple(param.shape)}: another LoRA rank or layout; resume with the one it was written "
                             "with")
        param.copy_(state[name])
