"""A training run's checkpoint (`<default_local_dir>/checkpoints/step_<k>`, one file per rank: checkpointing.py) as a
Hugging Face directory, for `tools/convert_mcore_to_hf.py` and `megatron-cpo convert-mcore-to-hf` (a torch_dist
checkpoint goes to models/conversion_commands.py): a LoRA actor's adapters as a PEFT adapter directory (what the run
exports into `step_<k>/huggingface` with `hf_model` in `save_contents`), or with `--merge` merged into the base as a
full model; a fully trained actor as a full model.

The rank files are shards of the run's layout, so the conversion runs on as many processes as the run had, each
loading its own file into the actor rebuilt on the base model (`--hf-config`: the run's `model.path`) from the
layout and LoRA settings the manifest records, as resume does; the trainer's own export writes it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.models.config import LoraConfig
from megatron_cpo.models.conversion_commands import (
    DTYPES,
    ConversionLayout,
    check_output_dir,
    config_dtype,
    export_hf_model,
    publish,
    run_mcore_to_hf,
    staging_dir,
)
from megatron_cpo.trainer.run.checkpoint_files import (
    HF_DIR,
    LATEST,
    MANIFEST,
    ActorRecord,
    CheckpointError,
    rank_file_name,
    read_latest,
    step_dir_name,
    verify_checkpoint,
)

FLAGS = {"tensor_model_parallel_size": "--tp", "pipeline_model_parallel_size": "--pp",
         "expert_model_parallel_size": "--ep", "expert_tensor_parallel_size": "--etp"}


def run_checkpoint_dir(path: str | Path) -> Path | None:
    """The step directory `path` names when it is a run's checkpoint (a step directory, or the checkpoints directory
    whose `latest` names one); None otherwise (a torch_dist checkpoint)."""
    path = Path(path)
    if (path / LATEST).is_file():
        try:
            step_dir = path / step_dir_name(read_latest(path))
        except CheckpointError as err:
            raise ValueError(f"{err}; pass a step directory (<checkpoints>/step_<k>) instead") from err
        if not step_dir.is_dir():
            raise ValueError(f"{path / LATEST} names {step_dir.name}, which does not exist; pass a step directory "
                             "(<checkpoints>/step_<k>) instead")
        return step_dir
    if (path / MANIFEST).is_file() or (path / rank_file_name(0)).is_file():
        return path
    return None


def read_actor_record(step_dir: Path) -> tuple[int, ActorRecord]:
    """The world size and the actor's record of a run's checkpoint, from its manifest."""
    manifest = json.loads((step_dir / MANIFEST).read_text()) if (step_dir / MANIFEST).is_file() else {}
    if "actor" not in manifest:
        raise ValueError(f"checkpoint {str(step_dir)!r} does not record the actor's layout and LoRA settings (it was "
                         f"written before checkpoints did): convert its {HF_DIR}/ export instead (a LoRA run's is "
                         "the PEFT adapter; megatron-cpo merge-lora merges it), or resume the run with this version "
                         "until it checkpoints again")
    return manifest["world_size"], ActorRecord(**manifest["actor"])


def _check_layout(step_dir: Path, world_size: int, record: ActorRecord, asked: dict[str, int | None]) -> None:
    """The conversion runs at the run's layout and world size: one-line errors for a flag or torchrun that differs."""
    layout = ", ".join(f"{name}={size}" for name, size in record.parallel.items())
    wrong = [f"{FLAGS[name]} {size}" for name, size in asked.items()
             if size is not None and size != record.parallel[name]]
    if wrong:
        raise ValueError(f"checkpoint {str(step_dir)!r} was written at {layout} and converts at that layout (each rank "
                         f"loads its own file): drop {', '.join(wrong)}")
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    if processes != world_size:
        raise ValueError(f"checkpoint {str(step_dir)!r} was written by {world_size} ranks ({layout}), one file each, "
                         f"and this conversion has {processes} process(es); run it under torchrun --nproc-per-node "
                         f"{world_size}")


def _raise_on_every_rank(problem: str | None) -> None:
    """Collective: every rank raises the first rank's problem (none goes on alone into the next collective)."""
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise ValueError(found)


def _state_problem(expected: dict[str, torch.Tensor], saved: dict[str, torch.Tensor], where: str,
                   base_dir: str | Path) -> str | None:
    """Why this rank's saved tensors do not fit the model rebuilt on `base_dir` (names and shapes), or None."""
    expected = {name: t for name, t in expected.items() if not name.endswith("_extra_state")}
    saved = {name: t for name, t in saved.items() if not name.endswith("_extra_state")}
    missing, extra = sorted(set(expected) - set(saved)), sorted(set(saved) - set(expected))
    wrong = [f"{name} {tuple(saved[name].shape)} (the model's: {tuple(t.shape)})" for name, t in expected.items()
             if name in saved and tuple(saved[name].shape) != tuple(t.shape)]
    found = ([f"lacks {missing[:3]}"] if missing else []) + ([f"holds {extra[:3]}"] if extra else []) + wrong[:2]
    if not found:
        return None
    return (f"{where} does not fit the model of --hf-config {str(base_dir)!r}: it {'; '.join(found)}; pass the base "
            "model the run trained (its actor_rollout_ref.model.path)")


def _lora_settings(record: ActorRecord) -> LoraConfig:
    known = {field.name for field in dataclasses.fields(LoraConfig)}
    return LoraConfig(**{**{k: v for k, v in record.lora.items() if k in known}, "adapter_path": None})


def convert_run_checkpoint(checkpoint: str | Path, out_dir: str | Path, base_dir: str | Path, *, merge: bool = False,
                           dtype: str | None = None, force: bool = False, max_shard_gb: float = 5.0,
                           asked_layout: dict[str, int | None] | None = None,
                           log: Callable[[str], None] = print) -> Path:
    """Write the actor of a run's checkpoint (`checkpoint`: a step directory, or the checkpoints directory: its
    latest) on the base model `base_dir` to `out_dir`: a LoRA actor as a PEFT adapter directory (tensors in `dtype`,
    default as saved) or with `merge` as the merged full model; a fully trained actor as a full model (in `dtype`,
    default the config's). Collective: run on as many processes as the run had (`asked_layout`: the --tp/--pp/--ep/
    --etp given, which must be the run's)."""
    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.models.lora.apply import apply_lora, load_trainable_state, trainable_state
    from megatron_cpo.models.lora.peft_format import save_peft_adapter
    from megatron_cpo.models.weight_mapping import load_hf_weights

    out = check_output_dir(out_dir, force)
    step_dir = run_checkpoint_dir(checkpoint)
    if step_dir is None:
        raise ValueError(f"{str(checkpoint)!r} is not a training run's checkpoint (no {MANIFEST}, rank files or "
                         f"{LATEST}); pass <default_local_dir>/checkpoints/step_<k>")
    world_size, record = read_actor_record(step_dir)
    if merge and record.lora is None:
        raise ValueError(f"--merge: checkpoint {str(step_dir)!r} holds a fully trained actor, no LoRA adapters to "
                         "merge; drop --merge (the output is the full model)")
    _check_layout(step_dir, world_size, record, asked_layout or {})
    sizes = record.parallel
    hf_config = load_hf_config(base_dir)
    ConversionLayout(sizes["tensor_model_parallel_size"], sizes["pipeline_model_parallel_size"],
                     sizes["expert_model_parallel_size"], sizes["expert_tensor_parallel_size"]).check(hf_config)
    platform.init_distributed(**sizes)
    say = log if dist.get_rank() == 0 else (lambda message: None)
    start, where = time.perf_counter(), f"checkpoint {str(step_dir)!r}"
    rank_file = rank_file_name(dist.get_rank())
    _raise_on_every_rank(verify_checkpoint(step_dir, world_size, rank_file))
    saved = torch.load(step_dir / rank_file, map_location="cpu", weights_only=False)["model"]
    kind = "LoRA adapters" if record.lora else "fully trained actor"
    say(f"[1/2] loading the {kind} of {step_dir} ({world_size} rank file(s)) on {base_dir}")
    model = build_gpt_model(hf_config)
    if merge:
        load_hf_weights(model, base_dir)  # the base under the adapters (a fully trained actor's files hold it all)
    if record.lora is not None:
        apply_lora(model, _lora_settings(record))
        _raise_on_every_rank(_state_problem(trainable_state(model), saved, where, base_dir))
        load_trainable_state(model, saved, where)
    else:
        _raise_on_every_rank(_state_problem(model.state_dict(), saved, where, base_dir))
        model.load_state_dict(saved, strict=False)
    if record.lora is not None and not merge:
        adapter_dtype = DTYPES[dtype] if dtype else next(iter(saved.values())).dtype
        say(f"[2/2] writing the PEFT adapter ({adapter_dtype}) to {out}")
        staging = staging_dir(out)
        save_peft_adapter(model, staging, str(base_dir), dtype=adapter_dtype)
        publish(staging, out)
    else:
        save_dtype = DTYPES[dtype or config_dtype(hf_config)]
        say(f"[2/2] writing the {'merged ' if merge else ''}HF model ({save_dtype}) to {out}")
        export_hf_model(model, hf_config, base_dir, out, dtype=save_dtype, max_shard_bytes=int(max_shard_gb * 2**30),
                        say=say)
    say(f"done in {time.perf_counter() - start:.1f} s: {out}")
    return out


def run_checkpoint_to_hf(args: argparse.Namespace) -> None:
    """Entry for `tools/convert_mcore_to_hf.py` and `megatron-cpo convert-mcore-to-hf`: a run's checkpoint here, a
    torch_dist one in models/conversion_commands.py."""
    if run_checkpoint_dir(args.mcore) is None:
        if args.merge:
            raise ValueError(f"--merge: {args.mcore!r} is not a training run's checkpoint, and a torch_dist one "
                             "holds no LoRA adapters to merge (a LoRA run's checkpoints/step_<k> does); drop --merge")
        run_mcore_to_hf(args)
        return
    asked = {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp,
             "expert_model_parallel_size": args.ep, "expert_tensor_parallel_size": args.etp}
    try:
        convert_run_checkpoint(args.mcore, args.out, args.hf_config, merge=args.merge, dtype=args.dtype,
                               force=args.force, max_shard_gb=args.max_shard_gb, asked_layout=asked)
    finally:
        platform.destroy_distributed()

