"""The two conversion commands (HF -> Megatron torch_dist, Megatron -> HF), shared by `tools/` and `megatron-cpo`.

Both run under torchrun (or as one process), print progress on rank 0, refuse a non-empty output directory unless
`force` is set, and write into `<out>.partial` first, moving it into place only when everything is written, so an
interrupted run never leaves a half-written checkpoint where a good one was.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_cpo import platform

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".safetensors.index.json", ".bin.index.json")


def config_dtype(hf_config) -> str:
    """The dtype name the HF config declares (`dtype`, or `torch_dtype` in older configs) if we can write it, else
    float32: converters write what the model was published in unless told otherwise."""
    declared = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None) or "float32"
    name = str(declared).removeprefix("torch.")
    return name if name in DTYPES else "float32"


def check_output_dir(out_dir: str | Path, force: bool) -> Path:
    """The output path, or an error when it holds files and `force` is not set (nothing is deleted here)."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"output {str(out)!r} exists and is not a directory; choose another --out")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise FileExistsError(f"output directory {str(out)!r} is not empty; pass --force to replace it or choose "
                              f"another --out")
    return out


@dataclass(frozen=True)
class ConversionLayout:
    """The parallel layout a conversion runs at: TP x PP, and for mixture-of-experts models EP (experts per rank
    group) and ETP (each expert split over ETP ranks; None = TP)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    etp: int | None = None

    @property
    def world_size(self) -> int:
        """The fewest processes that hold the layout: PP x lcm(TP, EP x ETP) (the dense layers replicate over the
        ranks EP needs beyond TP)."""
        return self.pp * math.lcm(self.tp, self.ep * (self.etp or self.tp))

    def describe(self) -> str:
        experts = f" EP={self.ep} ETP={self.etp or self.tp}" if self.ep > 1 or self.etp not in (None, self.tp) else ""
        return f"TP={self.tp} PP={self.pp}{experts}"

    def check(self, hf_config) -> None:
        """The model splits over this layout (a clear error before any process group starts)."""
        from megatron_cpo.models.builder import check_hf_config

        check_hf_config(hf_config, self.tp, self.pp, self.ep, self.etp)


def _init_model_parallel(layout: ConversionLayout) -> None:
    """Join the torchrun group at exactly `layout.world_size` processes (more replicas would only repeat work)."""
    platform.init_distributed(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                              expert_model_parallel_size=layout.ep, expert_tensor_parallel_size=layout.etp)
    if dist.get_world_size() != layout.world_size:
        raise ValueError(f"conversion at {layout.describe()} runs at exactly {layout.world_size} process(es) but "
                         f"torchrun started {dist.get_world_size()}; use torchrun --nproc-per-node "
                         f"{layout.world_size}")


def _rank0_log(log: Callable[[str], None]) -> Callable[[str], None]:
    return lambda message: log(message) if dist.get_rank() == 0 else None


def staging_dir(out: Path) -> Path:
    """Create a fresh `<out>.partial` on rank 0 and wait for every rank to see it."""
    staging = out.with_name(out.name + ".partial")
    if dist.get_rank() == 0:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    dist.barrier()
    return staging


def publish(staging: Path, out: Path) -> None:
    """Move the finished `staging` directory to `out` (replacing it), once every rank has finished writing."""
    dist.barrier()
    if dist.get_rank() == 0:
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    dist.barrier()


def convert_hf_to_mcore(hf_dir: str | Path, out_dir: str | Path, *, tp: int = 1, pp: int = 1, ep: int = 1,
                        etp: int | None = None, dtype: str | None = None, force: bool = False,
                        log: Callable[[str], None] = print) -> Path:
    """Write the HF model in `hf_dir` as a torch_dist Megatron checkpoint (loadable at any TP/PP/EP) to `out_dir`.

    Parameters are stored in `dtype` (default: the HF config's dtype, e.g. bfloat16, else float32). Config options the
    Megatron model cannot reproduce are refused before any process group starts (see models/hf_options.py and
    models/families/).
    """
    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.models.checkpoint import save_checkpoint
    from megatron_cpo.models.weight_mapping import load_hf_weights

    out = check_output_dir(out_dir, force)
    hf_config = load_hf_config(hf_dir)
    layout = ConversionLayout(tp, pp, ep, etp)
    layout.check(hf_config)
    dtype = dtype or config_dtype(hf_config)
    _init_model_parallel(layout)
    say = _rank0_log(log)
    start = time.perf_counter()
    say(f"[1/3] building {hf_config.model_type} GPTModel ({hf_config.num_hidden_layers} layers) at "
        f"{layout.describe()}, {dist.get_world_size()} process(es), {platform.backend()}, {dtype}")
    model = build_gpt_model(hf_config, params_dtype=DTYPES[dtype])
    say(f"[2/3] loading HF weights from {hf_dir}")
    load_hf_weights(model, hf_dir)
    say(f"[3/3] saving torch_dist checkpoint to {out}")
    staging = staging_dir(out)
    save_checkpoint(model, staging)
    publish(staging, out)
    say(f"done in {time.perf_counter() - start:.1f} s: {out}")
    return out


def _copy_non_weight_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, dst / path.name)
            copied.append(path.name)
    return copied


def _write_stage_shards(model, hf_config, staging: Path, dtype: torch.dtype, max_shard_bytes: int,
                        say: Callable[[str], None]) -> list[dict]:
    """Stream this stage's HF tensors into safetensors files `stage{pp}-part{k}`; returns what each file holds."""
    from megatron.core import parallel_state
    from safetensors.torch import save_file

    from megatron_cpo.models.weight_mapping import iter_hf_weights

    stage = parallel_state.get_pipeline_model_parallel_rank()
    files: list[dict] = []
    buffer: dict[str, torch.Tensor] = {}
    buffered_bytes = 0

    def flush() -> None:
        nonlocal buffer, buffered_bytes
        if buffer:
            name = f"stage{stage:03d}-part{len(files):05d}.safetensors"
            save_file(buffer, str(staging / name), metadata={"format": "pt"})
            files.append({"file": name, "tensors": list(buffer), "bytes": buffered_bytes})
            buffer, buffered_bytes = {}, 0

    for name, tensor in iter_hf_weights(model, hf_config):
        say(f"  {name} {tuple(tensor.shape)}")
        buffer[name] = tensor.to(device="cpu", dtype=dtype, copy=True).contiguous()
        buffered_bytes += buffer[name].numel() * buffer[name].element_size()
        if buffered_bytes >= max_shard_bytes:
            flush()
    flush()
    return files


def _name_shards(staging: Path, files: list[dict]) -> None:
    """Rename the stage files to HF's `model-0000k-of-0000n.safetensors` (or `model.safetensors`) and index them."""
    if len(files) == 1:
        (staging / files[0]["file"]).rename(staging / "model.safetensors")
        return
    weight_map = {}
    for number, entry in enumerate(files, start=1):
        final = f"model-{number:05d}-of-{len(files):05d}.safetensors"
        (staging / entry["file"]).rename(staging / final)
        weight_map.update({tensor: final for tensor in entry["tensors"]})
    index = {"metadata": {"total_size": sum(entry["bytes"] for entry in files)},
             "weight_map": dict(sorted(weight_map.items()))}
    (staging / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_mcore_to_hf(mcore_dir: str | Path, out_dir: str | Path, hf_config_dir: str | Path, *, tp: int = 1,
                        pp: int = 1, ep: int = 1, etp: int | None = None, dtype: str | None = None,
                        force: bool = False, max_shard_gb: float = 5.0, log: Callable[[str], None] = print) -> Path:
    """Write the torch_dist checkpoint in `mcore_dir` as an HF model directory (weights, config, tokenizer).

    `hf_config_dir` is the HF directory the checkpoint came from: its config and tokenizer files are copied. Tensors
    are saved in `dtype` (default: the config's dtype, else float32). `mcore_dir` may be a plain Megatron-Core
    checkpoint (Megatron-LM, verl) whose tensors match the config; the checkpoint may be saved at any TP/PP/EP.
    """
    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.models.checkpoint import load_checkpoint, read_checkpoint_info

    out = check_output_dir(out_dir, force)
    hf_config = load_hf_config(hf_config_dir)
    read_checkpoint_info(mcore_dir)
    layout = ConversionLayout(tp, pp, ep, etp)
    layout.check(hf_config)
    save_dtype = DTYPES[dtype or config_dtype(hf_config)]
    _init_model_parallel(layout)
    say = _rank0_log(log)
    start = time.perf_counter()
    say(f"[1/3] loading torch_dist checkpoint {mcore_dir} at {layout.describe()}")
    model = build_gpt_model(hf_config)
    load_checkpoint(model, mcore_dir)
    say(f"[2/3] writing HF tensors ({save_dtype}) to {out}")
    export_hf_model(model, hf_config, hf_config_dir, out, dtype=save_dtype, max_shard_bytes=int(max_shard_gb * 2**30),
                    say=say)
    say(f"done in {time.perf_counter() - start:.1f} s: {out}")
    return out


def export_hf_model(model, hf_config, hf_source_dir: str | Path, out_dir: str | Path, *,
                    dtype: torch.dtype = torch.float32, max_shard_bytes: int = 5 * 2**30,
                    say: Callable[[str], None] = lambda message: None) -> Path:
    """Collective over every rank: write a (TP/PP-sharded, DP-replicated) Megatron model as an HF model directory.

    Each stage's exporting rank streams its layers into safetensors files, rank 0 indexes them and copies config and
    tokenizer; a value model is written as token classification (value_head.py). Written to `<out_dir>.partial` first.
    """
    from megatron_cpo.models.builder import unwrap_model
    from megatron_cpo.models.value_head import head_has_bias, value_model_config

    out = Path(out_dir)
    staging = staging_dir(out)
    files = _write_stage_shards(model, hf_config, staging, dtype, max_shard_bytes, say)
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, files)
    if dist.get_rank() == 0:
        _name_shards(staging, [entry for rank_files in per_rank for entry in rank_files])
        say(f"[3/3] copying config and tokenizer from {hf_source_dir}: "
            f"{', '.join(_copy_non_weight_files(Path(hf_source_dir), staging))}")
        if unwrap_model(model).value_head:
            value_model_config(hf_config, head_has_bias(hf_config)).to_json_file(staging / "config.json")
    publish(staging, out)
    return out


def add_expert_arguments(parser: argparse.ArgumentParser, ep_default: int | None = 1) -> None:
    """--ep / --etp of both conversion commands (mixture-of-experts models)."""
    parser.add_argument("--ep", type=int, default=ep_default,
                        help="expert-parallel size used while converting (MoE models; default 1)")
    parser.add_argument("--etp", type=int, default=None,
                        help="expert-tensor-parallel size used while converting (default: --tp)")


def add_hf_to_mcore_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of the HF -> Megatron command (shared by the tool and the CLI)."""
    parser.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    parser.add_argument("--out", required=True, help="output directory for the torch_dist checkpoint")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size used while converting")
    parser.add_argument("--pp", type=int, default=1, help="pipeline-parallel size used while converting")
    add_expert_arguments(parser)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="parameter dtype of the checkpoint (default: the HF config's dtype, else float32)")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    return parser


def add_mcore_to_hf_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The flags of the Megatron -> HF command (shared by the tool and the CLI)."""
    parser.add_argument("--mcore", required=True,
                        help="torch_dist checkpoint directory (ours, or a plain Megatron-LM/verl one of this model), "
                             "or a training run's checkpoint (<default_local_dir>/checkpoints/step_<k>, or the "
                             "checkpoints directory: the step its `latest` names)")
    parser.add_argument("--out", required=True,
                        help="output Hugging Face model directory (a LoRA run's checkpoint: PEFT adapter directory)")
    parser.add_argument("--hf-config", required=True,
                        help="HF directory the checkpoint came from (its config and tokenizer are copied; a run's "
                             "checkpoint: the run's actor_rollout_ref.model.path, the base of its adapters)")
    parser.add_argument("--tp", type=int, default=None,
                        help="tensor-parallel size used while converting (default 1; a run's checkpoint: its own)")
    parser.add_argument("--pp", type=int, default=None,
                        help="pipeline-parallel size used while converting (default 1; a run's checkpoint: its own)")
    add_expert_arguments(parser, ep_default=None)
    parser.add_argument("--merge", action="store_true",
                        help="a LoRA run's checkpoint: write its adapters merged into the base (--hf-config) as a "
                             "full model instead of the PEFT adapter directory")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                        help="dtype of the written tensors (default: the config's dtype; a PEFT adapter: the "
                             "checkpoint's)")
    parser.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file to write")
    parser.add_argument("--force", action="store_true", help="replace a non-empty output directory")
    return parser


def run_hf_to_mcore(args: argparse.Namespace) -> None:
    """Entry for `tools/convert_hf_to_mcore.py` and `megatron-cpo convert-hf-to-mcore`."""
    try:
        convert_hf_to_mcore(args.hf, args.out, tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dtype=args.dtype,
                            force=args.force)
    finally:
        platform.destroy_distributed()


def run_mcore_to_hf(args: argparse.Namespace) -> None:
    """The torch_dist side of `tools/convert_mcore_to_hf.py` and `megatron-cpo convert-mcore-to-hf` (a training run's
    checkpoint: trainer/run/checkpoint_conversion.py)."""
    try:
        convert_mcore_to_hf(args.mcore, args.out, args.hf_config, tp=args.tp or 1, pp=args.pp or 1, ep=args.ep or 1,
                            etp=args.etp, dtype=args.dtype, force=args.force, max_shard_gb=args.max_shard_gb)
    finally:
        platform.destroy_distributed()
