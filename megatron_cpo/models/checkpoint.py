"""Megatron distributed checkpoints (torch_dist format) of a model built by `build_gpt_model`.

Global tensors load at any TP/PP/EP/ETP; the padded vocabulary table is read whole and cut to the real rows. A small
JSON file records what the model was built from; plain Megatron-Core checkpoints load without it when names and
shapes match (docs/conversion.md, "Checkpoints at any layout").
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo.models.builder import unwrap_model

CHECKPOINT_INFO = "megatron_cpo_checkpoint.json"
MEGATRON_LM_TRACKER = "latest_checkpointed_iteration.txt"
VOCAB_KEYS = ("embedding.word_embeddings.weight", "output_layer.weight")
MODEL_KEY_PREFIXES = ("embedding.", "decoder.", "output_layer.")  # a GPTModel's tensors (not optimizer, not rng)


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


def resolve_checkpoint_dir(ckpt_dir: str | Path) -> Path:
    """The torch_dist directory of `ckpt_dir`: itself, or the iteration Megatron-LM's tracker file points to."""
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    path = Path(ckpt_dir)
    tracker = path / MEGATRON_LM_TRACKER
    if tracker.is_file():
        iteration = tracker.read_text().strip()
        path = path / (iteration if iteration == "release" else f"iter_{int(iteration):07d}")
    if not check_is_distributed_checkpoint(str(path)):
        raise FileNotFoundError(f"{str(path)!r} is not a Megatron-Core torch_dist checkpoint (no metadata.json); "
                                f"write one with tools/convert_hf_to_mcore.py, the trainer or Megatron-LM")
    return path


def read_checkpoint_info(ckpt_dir: str | Path) -> dict:
    """What `save_checkpoint` recorded about the model; {} for a plain Megatron-Core checkpoint without that file."""
    path = resolve_checkpoint_dir(ckpt_dir) / CHECKPOINT_INFO
    return json.loads(path.read_text()) if path.is_file() else {}


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


def _sharded_tensors(entry: Any) -> list:
    """The ShardedTensors an entry of a sharded state dict stands for (a factory builds its own)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    if isinstance(entry, ShardedTensorFactory):
        built = entry.build()
        return [t for t in (built.values() if isinstance(built, dict) else built) if isinstance(t, ShardedTensor)]
    return [entry] if isinstance(entry, ShardedTensor) else []


def _check_saved_tensors(request: dict, saved: dict, path: Path, hf_vocab_size: int) -> None:
    """Raise naming the tensors the checkpoint lacks, has with another shape, or has and no rank of the model asks for.

    Collective: each PP stage asks for its own tensors, so the keys and problems are gathered over all ranks and
    every rank raises the same error (none goes on into the collective load alone)."""
    problems = []
    tensors = [t for entry in request.values() for t in _sharded_tensors(entry)]
    for tensor in tensors:
        if tensor.key not in saved:
            problems.append(f"{tensor.key} is missing")
            continue
        have, want = tuple(saved[tensor.key].global_shape), tuple(tensor.global_shape)
        if tensor.key in VOCAB_KEYS and have[1:] == want[1:]:
            if have[0] < hf_vocab_size:
                problems.append(f"{tensor.key} has {have[0]} vocabulary rows, fewer than vocab_size={hf_vocab_size}")
        elif have != want:
            problems.append(f"{tensor.key} has shape {have}, the model {want}")
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, (sorted({t.key for t in tensors}), problems))
    requested = {key for keys, _ in per_rank for key in keys}
    problems = list(dict.fromkeys(p for _, rank_problems in per_rank for p in rank_problems))  # stacks share keys
    unused = sorted(k for k in saved if k.startswith(MODEL_KEY_PREFIXES) and k not in requested)
    if unused:
        problems.append(f"tensors the model does not have: {unused[:6]}{' ...' if len(unused) > 6 else ''}")
    if problems:
        raise ValueError(f"checkpoint {str(path)!r} does not match the model built from the HF config: "
                         f"{'; '.join(problems[:6])}; pass the HF config the checkpoint was trained from")


def _request_whole_vocab_tables(request: dict, saved: dict, dtype: torch.dtype) -> list[str]:
    """Replace each vocabulary entry whose saved padding differs from the model's by a request for the whole saved
    table (a torch_dist load reads any region of a global tensor); returns the replaced names.

    Collective: the lowest rank asking for a table is its main reader (Megatron checks each region has exactly one).
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    replaced = {name: entry.key for name, entry in request.items() if isinstance(entry, ShardedTensor)
                and entry.key in VOCAB_KEYS and tuple(saved[entry.key].global_shape) != tuple(entry.global_shape)}
    per_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, sorted(set(replaced.values())))
    for name, key in replaced.items():
        main_reader = min(rank for rank, keys in enumerate(per_rank) if key in keys)
        table = torch.empty(tuple(saved[key].global_shape), dtype=dtype)
        request[name] = ShardedTensor.from_rank_offsets(key, table, replica_id=int(dist.get_rank() != main_reader))
    return list(replaced)


def _local_vocab_slice(table: torch.Tensor, model: Any) -> torch.Tensor:
    """This TP rank's rows of the model's padded table, from a saved table with any padding (padding rows zero)."""
    from megatron.core import parallel_state

    rows = model.padded_vocab_size // parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * rows
    local = table.new_zeros(rows, *table.shape[1:])
    real = max(0, min(rows, model.hf_vocab_size - start))
    local[:real] = table[start:start + real]
    return local


def _model_only_common_strategy():
    """A common-state loader that skips `common.pt`: the model needs nothing from it, and Megatron-LM's holds its run
    arguments as pickled classes that torch.load refuses to unpickle safely."""
    from megatron.core.dist_checkpointing.strategies.common import TorchCommonLoadStrategy

    class ModelOnlyCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            return {}

    return ModelOnlyCommonLoad()


def load_checkpoint(model: Any, ckpt_dir: str | Path, *, extra_state: dict | None = None) -> dict:
    """Load a torch_dist checkpoint into `model` (any TP/PP layout); returns the loaded `extra_state` entries.

    Collective over all ranks. Accepts our checkpoints and plain Megatron-Core ones (see the module docstring); raises
    a clear error when the checkpoint is of another architecture or its tensors do not match the model's.
    """
    from megatron.core import dist_checkpointing

    path = resolve_checkpoint_dir(ckpt_dir)
    info = read_checkpoint_info(path)
    expected = _model_info(model)
    for key in ("model_type", "num_layers", "hidden_size", "hf_vocab_size"):
        if key in info and info[key] != expected[key]:
            raise ValueError(f"checkpoint {str(ckpt_dir)!r} has {key}={info[key]!r} but the model being loaded has "
                             f"{key}={expected[key]!r}; build the model from the HF config the checkpoint came from")
    model = unwrap_model(model)
    request = {name: entry for name, entry in model.sharded_state_dict().items()
               if not name.endswith("_extra_state")}  # Megatron's local and TE linears need no extra state to run
    saved = dist_checkpointing.load_tensors_metadata(str(path))
    _check_saved_tensors(request, saved, path, model.hf_vocab_size)
    resized = _request_whole_vocab_tables(request, saved, next(model.parameters()).dtype)
    if resized and extra_state:
        raise ValueError(f"checkpoint {str(ckpt_dir)!r} pads the vocabulary to {info.get('padded_vocab_size')} rows "
                         f"but this layout to {model.padded_vocab_size}; its optimizer state loads only at a TP size "
                         f"with the same padding (the weights alone load at any)")
    common = None if extra_state else _model_only_common_strategy()
    state = dist_checkpointing.load({"model": request, **(extra_state or {})}, str(path), common_strategy=common)
    weights = state.pop("model")
    for name in resized:
        weights[name] = _local_vocab_slice(weights[name], model)
    missing, unexpected = model.load_state_dict(weights, strict=False)
    missing = [name for name in missing if not name.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"loading {str(ckpt_dir)!r} left parameters {missing} unset and {unexpected} unused")
    return state
