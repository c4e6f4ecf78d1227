"""Megatron distributed checkpoints (torch_dist format) of a model built by `build_gpt_model`.

A torch_dist checkpoint stores every tensor as one global array with its shards' offsets, so a checkpoint saved at one
TP/PP layout loads at any other whose padded vocabulary is the same. Beside the shards, a small JSON file records
what the model was built from, so a mismatch is reported plainly instead of as a tensor-shape error deep in the loader.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_cpo.models.builder import unwrap_model

CHECKPOINT_INFO = "megatron_cpo_checkpoint.json"


def _model_info(model: Any) -> dict:
    from megatron.core import parallel_state

    model = unwrap_model(model)
    return {"model_type": model.hf_config.model_type,
            "num_layers": model.config.num_layers,
            "hidden_size": model.config.hidden_size,
            "hf_vocab_size": model.hf_vocab_size,
            "padded_vocab_size": model.padded_vocab_size,
            "saved_tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
            "saved_pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size()}


def read_checkpoint_info(ckpt_dir: str | Path) -> dict:
    """What `save_checkpoint` recorded about the model, or a clear error when `ckpt_dir` is not such a checkpoint."""
    path = Path(ckpt_dir) / CHECKPOINT_INFO
    if not path.is_file():
        raise FileNotFoundError(f"{str(ckpt_dir)!r} is not a megatron-cpo checkpoint (no {CHECKPOINT_INFO}); write "
                                f"one with tools/convert_hf_to_mcore.py or the trainer")
    return json.loads(path.read_text())


def save_checkpoint(model: Any, ckpt_dir: str | Path, *, extra_state: dict | None = None) -> None:
    """Save `model` (and optional extra sharded state, e.g. an optimizer's) as a torch_dist checkpoint.

    Collective over all ranks. `extra_state` holds sharded state dicts keyed by name (for example
    `{"optimizer": optimizer.sharded_state_dict(model_sharded_state)}`); they are saved beside `"model"`.
    """
    from megatron.core import dist_checkpointing

    path = Path(ckpt_dir)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save({"model": unwrap_model(model).sharded_state_dict(), **(extra_state or {})}, str(path))
    if dist.get_rank() == 0:
        (path / CHECKPOINT_INFO).write_text(json.dumps(_model_info(model), indent=2) + "\n")
    dist.barrier()


def load_checkpoint(model: Any, ckpt_dir: str | Path, *, extra_state: dict | None = None) -> dict:
    """Load a torch_dist checkpoint into `model` (any TP/PP layout); returns the loaded `extra_state` entries.

    Collective over all ranks. Raises a clear error when the checkpoint was saved from a different architecture or a
    padded vocabulary this layout cannot hold.
    """
    from megatron.core import dist_checkpointing

    info = read_checkpoint_info(ckpt_dir)
    expected = _model_info(model)
    for key in ("model_type", "num_layers", "hidden_size", "hf_vocab_size", "padded_vocab_size"):
        if info[key] != expected[key]:
            raise ValueError(f"checkpoint {str(ckpt_dir)!r} has {key}={info[key]!r} but the model being loaded has "
                             f"{key}={expected[key]!r}; build the model from the HF config the checkpoint came from"
                             + (" and a TP size whose padded vocabulary matches (the vocabulary is padded to a "
                                "multiple of TP)" if key == "padded_vocab_size" else ""))
    model = unwrap_model(model)
    state = dist_checkpointing.load({"model": model.sharded_state_dict(), **(extra_state or {})}, str(ckpt_dir))
    model.load_state_dict(state.pop("model"), strict=True)
    return state
