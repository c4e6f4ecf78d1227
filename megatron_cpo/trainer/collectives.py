"""The trainer's generic collectives: what all ranks call together to learn rank 0's decisions and batch.

Rank 0 decides (the batch, whether engines are lost, whether to stop) and the other ranks receive it here; the
driver (`driver/`: rank 0's `LeadDriver` sends, every other rank's `FollowerDriver` receives) and the workers (the
weight push, the sync probe) both build on these. Anything else runs on one rank without waiting for the others (the
forward/backward passes have their own collectives inside Megatron).
"""
from __future__ import annotations

from dataclasses import fields
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.batch.step_batch import StepBatch


def _distributed() -> bool:
    return dist.get_world_size() > 1


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` on every rank (small Python objects: flags, counts, messages)."""
    payload = [value]
    if _distributed():
        dist.broadcast_object_list(payload, src=0)
    return payload[0]


def all_gather_object(value: Any) -> list[Any]:
    """Every rank's `value`, in rank order (small Python objects: e.g. each node's engine URLs)."""
    if not _distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank (e.g. a SIGTERM that reached only some of them)."""
    value = torch.tensor([float(flag)], device=platform.device())  # NCCL reduces device tensors only
    if _distributed():
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return bool(value.item())


def barrier() -> None:
    """Every rank waits here until all arrive (e.g. the other ranks while rank 0 validates with their actors
    offloaded)."""
    if _distributed():
        dist.barrier()


def _batch_tensors(batch: StepBatch) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The batch as named tensors (ragged rows as `<field>.values` / `<field>.offsets`) and its other fields."""
    tensors, other = {}, {}
    for item in fields(batch):
        value = getattr(batch, item.name)
        if isinstance(value, RaggedRows):
            tensors[f"{item.name}.values"], tensors[f"{item.name}.offsets"] = value.values, value.offsets
        elif isinstance(value, torch.Tensor):
            tensors[item.name] = value
        else:
            other[item.name] = value
    return tensors, other


def _wire_dtype(tensor: torch.Tensor) -> torch.dtype:
    """int32 for int64 values that fit in it (token ids), else the tensor's own dtype."""
    if tensor.dtype == torch.long and tensor.numel():
        low, high = torch.aminmax(tensor)  # no temporary the size of the tensor (abs() would be one)
        if int(low) >= -2**31 and int(high) < 2**31:
            return torch.int32
    return tensor.dtype


def broadcast_batch(batch: StepBatch | None) -> StepBatch | None:
    """Rank 0's batch (or None: stop) on every rank: a small header (shapes, dtypes, scalars), then one broadcast per
    tensor, on the device the backend needs; token ids travel as int32 when they fit (half the bytes)."""
    if not _distributed():
        return batch
    header: list[Any] = [None]
    tensors: dict[str, torch.Tensor] = {}
    if dist.get_rank() == 0 and batch is not None:
        tensors, other = _batch_tensors(batch)
        header = [({name: (tuple(t.shape), t.dtype, _wire_dtype(t)) for name, t in tensors.items()}, other)]
    dist.broadcast_object_list(header, src=0)
    if header[0] is None:
        return None
    specs, other = header[0]
    received = {}
    for name, (shape, dtype, wire_dtype) in specs.items():
        sending = name in tensors
        wire = tensors[name].to(wire_dtype) if sending else torch.empty(shape, dtype=wire_dtype)
        wire = wire.contiguous().to(platform.device())
        dist.broadcast(wire.view(torch.uint8) if dtype == torch.bool else wire, src=0)
        received[name] = tensors[name] if sending else wire.cpu().to(dtype)  # rank 0 keeps its own tensor
    kwargs = dict(other)
    for item in fields(StepBatch):
        if f"{item.name}.values" in received:
            kwargs[item.name] = RaggedRows(received[f"{item.name}.values"], received[f"{item.name}.offsets"])
        elif item.name in received:
            kwargs[item.name] = received[item.name]
    return StepBatch(**kwargs)
