"""LoRA adapters in PEFT's format: a directory with `adapter_config.json` and `adapter_model.safetensors`, the tensors
named `base_model.model.<HF module>.lora_A.weight` [rank, in] / `.lora_B.weight` [out, rank] (what
`PeftModel.from_pretrained` and vLLM's `LoRARequest` load).

Megatron fuses q, k and v into `linear_qkv` and gate and up into `linear_fc1`, with one adapter each: the export
writes that adapter's A for each of the fused HF modules and splits its B by the layer's layout (by KV group for
q/k/v, as the weights are split, tensor_rules.py), as Megatron-Bridge's export does; the import takes a PEFT adapter
whose fused modules share one A (an exported one, or any trained that way) and refuses one whose q, k and v (or gate
and up) have different A's, which one fused adapter cannot hold.
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo.models.builder import unwrap_model
from megatron_cpo.models.config import LoraConfig
from megatron_cpo.models.lora.apply import adapter_sites, lora_of
from megatron_cpo.models.lora.layers import COLUMN
from megatron_cpo.models.lora.targets import AdaptableLayer, adaptable_layers, select_layers
from megatron_cpo.models.weight_mapping import (
    SafetensorsReader,
    _expert_shape,
    _ExportRoles,
    _gather_to_first,
    _shape,
)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_key(hf_module: str, factor: str) -> str:
    """PEFT's name of one factor (`A` or `B`) of the adapter on `hf_module` (e.g. `model.layers.0.self_attn.q_proj`)."""
    return f"base_model.model.{hf_module}.lora_{factor}.weight"


@torch.no_grad()
def iter_peft_tensors(model: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the model's adapters under PEFT's names, whole: collective over every rank, like
    `weight_mapping.iter_hf_weights` (each stage's exporting rank yields its layers' adapters, experts gathered from
    their EP ranks; other ranks yield nothing)."""
    from megatron.core import parallel_state as ps

    gpt = unwrap_model(model)
    shape = _shape(gpt, gpt.hf_config)
    expert_shape = _expert_shape(shape)
    roles = _ExportRoles.of_this_rank()
    for site in adapter_sites(gpt):
        adapter = getattr(site.entry.param, "lora_adapter", None)
        if adapter is None or not (roles.experts if site.expert else roles.dense):
            continue
        a_full, b_full = adapter.factors()
        if not site.expert:
            if roles.yields:
                yield from _peft_pairs(site.layer, a_full, site.entry.mapping.split(b_full, shape))
            continue
        if ps.get_expert_tensor_parallel_rank() != 0:
            continue
        group, size = ps.get_expert_model_parallel_group(), ps.get_expert_model_parallel_world_size()
        a_all, b_all = _gather_to_first(a_full, group, size), _gather_to_first(b_full, group, size)
        if roles.yields:
            for ep_rank, (a_rank, b_rank) in enumerate(zip(a_all, b_all)):
                hf_modules = tuple(name.removesuffix(".weight") for name in site.entry.hf_names(ep_rank))
                layer = AdaptableLayer(site.layer.canonical, site.layer.short, hf_modules)
                yield from _peft_pairs(layer, a_rank, site.entry.mapping.split(b_rank, expert_shape))


def _peft_pairs(layer: AdaptableLayer, a_full: torch.Tensor, b_parts: list[torch.Tensor]
                ) -> Iterator[tuple[str, torch.Tensor]]:
    for module, b_part in zip(layer.hf_modules, b_parts):
        yield peft_key(module, "A"), a_full
        yield peft_key(module, "B"), b_part


def peft_target_modules(layers: list[AdaptableLayer], selected: list[AdaptableLayer]) -> list[str]:
    """`target_modules` of the adapter config: HF short names when every layer of those kinds is adapted, else each
    adapted module's full name (PEFT matches either)."""
    chosen = {layer.canonical for layer in selected}
    shorts = {short for layer in selected for short in layer.hf_short}
    every = all(layer.canonical in chosen for layer in layers if set(layer.hf_short) & shorts)
    if every:
        return sorted(shorts)
    return [module for layer in selected for module in layer.hf_modules]


def adapter_config(lora: LoraConfig, hf_config: Any, base_model: str) -> dict:
    """PEFT's `adapter_config.json` of these adapters on the model of `hf_config` (started from `base_model`)."""
    layers = adaptable_layers(hf_config)
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model, "r": lora.rank,
            "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none", "fan_in_fan_out": False,
            "target_modules": peft_target_modules(layers, select_layers(layers, lora)), "modules_to_save": None,
            "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True}


def save_peft_adapter(model: Any, out_dir: str | Path, base_model: str, dtype: torch.dtype | None = None) -> Path:
    """Collective over every rank: write the model's adapters as a PEFT adapter directory `out_dir` (tensors in
    `dtype`, default the adapters'; `base_model`: the HF model they sit on, recorded as `base_model_name_or_path`).
    Each stage's exporting rank writes its part; rank 0 joins them into one file."""
    from safetensors.torch import load_file, save_file

    gpt = unwrap_model(model)
    lora = lora_of(gpt)
    if lora is None:
        raise ValueError("the model has no LoRA adapters to export")
    out = Path(out_dir)
    if dist.get_rank() == 0:
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
    dist.barrier()
    tensors = {name: tensor.to(device="cpu", dtype=dtype or tensor.dtype, copy=True).contiguous()
               for name, tensor in iter_peft_tensors(gpt)}
    part = out / f"part-{dist.get_rank():05d}.safetensors"
    if tensors:
        save_file(tensors, str(part))
    dist.barrier()
    if dist.get_rank() == 0:
        joined = {}
        for path in sorted(out.glob("part-*.safetensors")):
            joined.update(load_file(str(path)))
            path.unlink()
        save_file(dict(sorted(joined.items())), str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        config = adapter_config(lora, gpt.hf_config, base_model)
        (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    dist.barrier()
    return out


def read_adapter_config(adapter_dir: str | Path, where: str) -> dict:
    """The adapter directory's `adapter_config.json`, with one-line errors (`where`: the setting that named it)."""
    path = Path(adapter_dir)
    config_path, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_path.is_file() or not weights.is_file():
        raise ValueError(f"{where}={str(path)!r} is not a PEFT adapter directory (it needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}); point it at one, e.g. a LoRA run's checkpoints/step_<k>/huggingface")
    try:
        config = json.loads(config_path.read_text())
    except ValueError as err:
        raise ValueError(f"{where}={str(path)!r}: {ADAPTER_CONFIG} is not JSON ({err})") from err
    kind = config.get("peft_type")
    if kind != "LORA" or config.get("use_dora") or config.get("use_rslora") or config.get("modules_to_save"):
        raise ValueError(f"{where}={str(path)!r} is a {kind} adapter with use_dora={config.get('use_dora')}, "
                         f"use_rslora={config.get('use_rslora')}, modules_to_save={config.get('modules_to_save')}; "
                         "only plain LoRA adapters (alpha / r scale, no extra trained modules) load here")
    return config


def adapter_problems(adapter_dir: str | Path, base_dir: str | Path, hf_config: Any, lora: LoraConfig) -> list[str]:
    """Why the PEFT adapter in `adapter_dir` cannot start these adapters on the base model in `base_dir`: another
    rank or alpha, modules the targets do not select (or selected modules it lacks), tensors whose shapes are not
    this base's. Reads only the adapter's config and the two files' headers."""
    from safetensors import safe_open

    where = f"{lora.SECTION}.adapter_path"
    try:
        config = read_adapter_config(adapter_dir, where)
    except ValueError as err:
        return [str(err)]
    named = f"{where}={str(adapter_dir)!r}"
    if config.get("r") != lora.rank or float(config.get("lora_alpha", 0)) != float(lora.alpha):
        return [f"{named} was saved with r={config.get('r')}, lora_alpha={config.get('lora_alpha')}, and this run has "
                f"{lora.SECTION}.rank={lora.rank}, alpha={lora.alpha}; set them to the adapter's"]
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="pt") as file:
        saved = {name: tuple(file.get_slice(name).get_shape()) for name in file.keys()}
    base = SafetensorsReader(base_dir)
    expected = {}
    for layer in select_layers(adaptable_layers(hf_config), lora):
        for module in layer.hf_modules:
            out, width = _hf_shape(base, module)
            expected[peft_key(module, "A")], expected[peft_key(module, "B")] = (lora.rank, width), (out, lora.rank)
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    if missing or extra:
        return [f"{named} does not hold the adapters {lora.SECTION}.target_modules / exclude_modules select: "
                + (f"it lacks {missing[:3]}{' ...' if len(missing) > 3 else ''}" if missing else "")
                + ("; " if missing and extra else "")
                + (f"it holds {extra[:3]}{' ...' if len(extra) > 3 else ''}" if extra else "")
                + "; set the targets it was trained with"]
    wrong = [f"{name} {saved[name]} (this base needs {shape})" for name, shape in expected.items()
             if saved[name] != shape]
    if wrong:
        return [f"{named} was saved for another base model than {str(base_dir)!r}: {'; '.join(wrong[:2])}"]
    return []


def _hf_shape(reader: SafetensorsReader, module: str) -> tuple[int, int]:
    from safetensors import safe_open

    name = module + ".weight"
    if name not in reader.files:
        raise KeyError(f"{name} is not in the base model {str(reader.dir)!r}")
    with safe_open(str(reader.dir / reader.files[name]), framework="pt") as file:
        out, width = file.get_slice(name).get_shape()
    return out, width


@torch.no_grad()
def load_peft_adapter(model: Any, adapter_dir: str | Path) -> None:
    """Fill this rank's adapters (after `apply_lora`) from a PEFT adapter directory that `adapter_problems` accepts
    for them; a fused layer's modules must share one A."""
    from megatron.core import parallel_state as ps
    from safetensors import safe_open

    gpt = unwrap_model(model)
    lora = lora_of(gpt)
    where = f"{lora.SECTION}.adapter_path={str(adapter_dir)!r}"
    shape = _shape(gpt, gpt.hf_config)
    shapes = {False: shape, True: _expert_shape(shape)}
    ep_rank = ps.get_expert_model_parallel_rank()
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="pt") as file:
        for site in adapter_sites(gpt):
            adapter = getattr(site.entry.param, "lora_adapter", None)
            if adapter is None:
                continue
            modules = [name.removesuffix(".weight") for name in site.entry.hf_names(ep_rank)]
            a_parts = [file.get_tensor(peft_key(module, "A")) for module in modules]
            if any(not torch.equal(a_parts[0], part) for part in a_parts[1:]):
                raise ValueError(f"{where} has different lora_A for {', '.join(m.rsplit('.', 1)[-1] for m in modules)}"
                                 f" of layer {site.layer.canonical}: Megatron's fused {site.layer.short} has one "
                                 "adapter, so only adapters whose fused modules share A load here")
            b_full = site.entry.mapping.merge([file.get_tensor(peft_key(module, "B")) for module in modules],
                                              shapes[site.expert])
            size, index = adapter.size, adapter.rank_in_group
            a_shard = a_parts[0].chunk(size, dim=0 if adapter.kind == COLUMN else 1)[index]
            adapter.lora_A.copy_(a_shard)
            adapter.lora_B.copy_(b_full.chunk(size, dim=0)[index])
