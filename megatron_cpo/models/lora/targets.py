"""Which linear layers of a model carry a LoRA adapter: `lora.target_modules` / `exclude_modules` resolved against
the model's layers, with one-line errors naming what exists.

Every adaptable layer has a canonical name, Megatron's module name with the global layer index (and for a routed
expert its global index): `decoder.layers.3.self_attention.linear_qkv`,
`decoder.layers.3.mlp.experts.local_experts.17.linear_fc2`; and the Hugging Face modules it stands for
(`model.layers.3.self_attn.q_proj`, `...k_proj`, `...v_proj`). A target is a Megatron short name (`linear_qkv`), a
Hugging Face short name (`q_proj`: the fused layer is adapted when all of its HF modules are named), `all-linear`,
or an fnmatch pattern over the canonical or the Hugging Face names.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any

from megatron_cpo.models.config import LORA_TARGETS, LoraConfig

ALL_LINEAR = "all-linear"


@dataclass(frozen=True)
class AdaptableLayer:
    """One linear layer an adapter can sit on."""
    canonical: str
    short: str                   # linear_qkv, linear_proj, linear_fc1 or linear_fc2
    hf_modules: tuple[str, ...]  # the Hugging Face modules it stands for (q, k, v; gate, up; one otherwise)

    @property
    def hf_short(self) -> tuple[str, ...]:
        return tuple(name.rsplit(".", 1)[-1] for name in self.hf_modules)


def adaptable_layers(hf_config: Any, layers: range | None = None) -> list[AdaptableLayer]:
    """The model's adaptable layers (of `layers`, global indices; default all), in the order of its HF tensors."""
    from megatron_cpo.models.families import family_of

    family = family_of(hf_config)
    moe = family.moe(hf_config)
    found = []
    for index in layers if layers is not None else range(hf_config.num_hidden_layers):
        for mapping in family.layer_rules(hf_config, index):
            megatron = mapping.megatron_names[0]
            short = megatron.removesuffix(".weight").rsplit(".", 1)[-1]
            if not megatron.endswith(".weight") or short not in LORA_TARGETS:
                continue
            for expert in range(moe.num_experts) if mapping.expert else (None,):
                found.append(layer_named(index, megatron, mapping.hf_names, expert))
    return found


def layer_named(index: int, megatron_name: str, hf_names: tuple[str, ...], expert: int | None) -> AdaptableLayer:
    """The `AdaptableLayer` of a mapping's weight (`megatron_name`, `hf_names` as tensor_rules.py lists them) in
    layer `index`, for routed expert `expert` (global index; None: not an expert)."""
    module = megatron_name.removesuffix(".weight")
    canonical = f"decoder.layers.{index}.{module.format(local=expert)}"
    hf_modules = tuple(f"model.layers.{index}.{name.removesuffix('.weight').format(expert=expert)}"
                       for name in hf_names)
    return AdaptableLayer(canonical, module.rsplit(".", 1)[-1], hf_modules)


def _is_pattern(text: str) -> bool:
    return any(char in text for char in "*?[")


def _matches(layer: AdaptableLayer, name: str) -> set[str]:
    """Which of the layer's HF modules `name` selects (all of them for a Megatron name or pattern)."""
    if name == ALL_LINEAR or name == layer.short or (_is_pattern(name) and fnmatch.fnmatchcase(layer.canonical, name)):
        return set(layer.hf_modules)
    return {module for module, short in zip(layer.hf_modules, layer.hf_short)
            if name == short or (_is_pattern(name) and fnmatch.fnmatchcase(module, name))}


def _known_names(layers: list[AdaptableLayer]) -> str:
    megatron = sorted({layer.short for layer in layers}, key=LORA_TARGETS.index)
    hf = list(dict.fromkeys(short for layer in layers for short in layer.hf_short))
    example = layers[0].canonical if layers else "decoder.layers.0.self_attention.linear_qkv"
    return (f"the model has {', '.join(megatron)} (Hugging Face: {', '.join(hf)}), or all-linear, or patterns over "
            f"names like {example!r}")


def select_layers(layers: list[AdaptableLayer], lora: LoraConfig) -> list[AdaptableLayer]:
    """The layers `lora.target_modules` names and `lora.exclude_modules` does not; ValueError (one line, naming the
    setting and what exists) for a name that matches nothing, half of a fused layer, or nothing selected at all."""
    section = lora.SECTION
    picked: dict[str, set[str]] = {layer.canonical: set() for layer in layers}
    for name in lora.target_modules:
        hits = [(layer, _matches(layer, name)) for layer in layers]
        if not any(found for _, found in hits):
            raise ValueError(f"{section}.target_modules entry {name!r} matches no layer; {_known_names(layers)}")
        for layer, found in hits:
            picked[layer.canonical] |= found
    for layer in layers:
        chosen = picked[layer.canonical]
        if chosen and len(chosen) < len(layer.hf_modules):
            named = [short for module, short in zip(layer.hf_modules, layer.hf_short) if module in chosen]
            missing = [short for module, short in zip(layer.hf_modules, layer.hf_short) if module not in chosen]
            raise ValueError(f"{section}.target_modules names {', '.join(named)} without {', '.join(missing)}: "
                             f"Megatron's fused {layer.short} holds them in one layer with one adapter; name all "
                             f"of {', '.join(layer.hf_short)} (or {layer.short})")
    selected = [layer for layer in layers if picked[layer.canonical]]
    for name in lora.exclude_modules:
        hits = set()
        for layer in selected:
            found = _matches(layer, name)
            if found and len(found) < len(layer.hf_modules):
                raise ValueError(f"{section}.exclude_modules entry {name!r} names part of Megatron's fused "
                                 f"{layer.short} ({', '.join(layer.hf_short)}), which has one adapter; exclude all "
                                 f"of them (or {layer.short})")
            if found:
                hits.add(layer.canonical)
        if not hits:
            raise ValueError(f"{section}.exclude_modules entry {name!r} matches no targeted layer; "
                             f"{_known_names(selected)}")
        selected = [layer for layer in selected if layer.canonical not in hits]
    if not selected:
        raise ValueError(f"{section}.exclude_modules removes every layer target_modules names; keep at least one")
    return selected


def layout_problems(hf_config: Any, lora: LoraConfig, tp: int, pp: int, etp: int) -> list[str]:
    """What stops these adapters before anything starts: targets that select nothing (or half a fused layer), a rank
    a column-parallel layer's tensor-parallel group does not divide (Megatron-Bridge splits the rank there), a
    pipeline stage left without an adapter."""
    layers = adaptable_layers(hf_config)
    try:
        selected = select_layers(layers, lora)
    except ValueError as err:
        return [str(err)]
    problems = []
    experts = any(".experts." in layer.canonical for layer in selected)
    for size, what, key in ((tp, "tensor", "tensor_model_parallel_size"),
                            (etp if experts else 1, "expert-tensor", "expert_tensor_parallel_size")):
        if lora.rank % size:
            problems.append(f"{lora.SECTION}.rank={lora.rank} does not split over {what}-parallel size {size} "
                            f"(actor_rollout_ref.actor.megatron.{key}; an adapter's rank is split over it on "
                            f"column-parallel layers, as Megatron-Bridge does); choose a multiple of {size}")
    per_stage = hf_config.num_hidden_layers // pp
    used = {int(layer.canonical.split(".")[2]) // per_stage for layer in selected}
    empty = [stage for stage in range(pp) if stage not in used]
    if empty:
        problems.append(f"{lora.SECTION}.target_modules / exclude_modules leave pipeline stage(s) {empty} of "
                        f"pipeline_model_parallel_size={pp} without an adapter (nothing to train there); target "
                        "layers on every stage or lower the pipeline size")
    return problems
