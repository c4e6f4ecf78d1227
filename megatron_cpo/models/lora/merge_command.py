"""`megatron-cpo merge-lora`: a PEFT LoRA adapter (a LoRA run's `checkpoints/step_<k>/huggingface`, or any PEFT
adapter of plain LoRA) merged into its Hugging Face base model, written as a full model directory.

Tensor by tensor, file by file as the base is sharded: a weight with an adapter becomes `W + (lora_alpha / r) B A`
(computed in float32, stored in the base's dtype unless `--dtype` says otherwise), every other tensor is copied; the
config, tokenizer and other files are copied. Needs no GPU and no Megatron; written into `<out>.partial` first and moved
into place when complete.
"""
from __future__ import annotations

import argparse
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_cpo.models.lora.peft_format import ADAPTER_WEIGHTS, read_adapter_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PEFT_PREFIX = "base_model.model."


def _adapter_factors(adapter_dir: Path) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{base weight name: (A, B)} of the adapter's tensors."""
    from safetensors.torch import load_file

    tensors = load_file(str(adapter_dir / ADAPTER_WEIGHTS))
    factors = {}
    for name in tensors:
        if name.endswith(".lora_A.weight"):
            module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
            b_name = name.replace(".lora_A.weight", ".lora_B.weight")
            if b_name not in tensors:
                raise ValueError(f"adapter {str(adapter_dir)!r} holds {name} without its {b_name}")
            factors[module + ".weight"] = (tensors[name], tensors[b_name])
    return factors


def merge_lora(base_dir: str | Path, adapter_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
               force: bool = False, log: Callable[[str], None] = print) -> Path:
    """Write `base_dir` with the adapter of `adapter_dir` merged in to `out_dir` (see the module docstring)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_cpo.models.conversion_commands import WEIGHT_SUFFIXES, check_output_dir
    from megatron_cpo.models.weight_mapping import SafetensorsReader

    out, adapter = check_output_dir(out_dir, force), Path(adapter_dir)
    config = read_adapter_config(adapter, "--adapter")
    scale = float(config["lora_alpha"]) / float(config["r"])
    factors = _adapter_factors(adapter)
    reader = SafetensorsReader(base_dir)
    unknown = sorted(set(factors) - set(reader.files))
    if unknown:
        raise ValueError(f"adapter {str(adapter)!r} adapts {unknown[:3]}, which the base {str(base_dir)!r} does not "
                         "have: it was trained on another base model")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    merged = 0
    for file in sorted(set(reader.files.values())):
        tensors = {}
        with safe_open(str(reader.dir / file), framework="pt") as opened:
            for name in opened.keys():
                tensor = opened.get_tensor(name)
                target = DTYPES[dtype] if dtype else tensor.dtype
                if name in factors:
                    a, b = factors[name]
                    if tuple(a.shape) != (config["r"], tensor.shape[1]) or tuple(b.shape) != (tensor.shape[0],
                                                                                             config["r"]):
                        raise ValueError(f"adapter {str(adapter)!r} has {name}'s A {tuple(a.shape)} and B "
                                         f"{tuple(b.shape)}, the base's weight is {tuple(tensor.shape)}: it was "
                                         "trained on another base model")
                    tensor = tensor.float() + scale * (b.float() @ a.float())
                    merged += 1
                tensors[name] = tensor.to(target).contiguous()
        save_file(tensors, str(staging / file), metadata={"format": "pt"})
    for path in sorted(Path(base_dir).iterdir()):
        if path.is_file() and (not path.name.endswith(WEIGHT_SUFFIXES) or path.name.endswith(".index.json")):
            shutil.copy2(path, staging / path.name)
    if dtype:
        hf_config = json.loads((staging / "config.json").read_text())
        (staging / "config.json").write_text(json.dumps({**hf_config, "dtype": dtype}, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    log(f"merged {merged} adapted weight(s) (scale {scale:g}) of {adapter} into {base_dir}: {out}")
    return out


def add_merge_lora_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--base", required=True, help="the Hugging Face base model directory the adapter sits on")
    parser.add_argument("--adapter", required=True,
                        help="a PEFT LoRA adapter directory (e.g. a LoRA run's checkpoints/step_<k>/huggingface)")
    parser.add_argument("--out", required=True, help="output Hugging Face model directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written tensors (default: the base's)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    return parser


def run_merge_lora(args: argparse.Namespace) -> None:
    merge_lora(args.base, args.adapter, args.out, dtype=args.dtype, force=args.force)
