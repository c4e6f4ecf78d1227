"""Weight buckets: HF-named tensors packed into one flat byte buffer, with a small table to cut it back.

A sending rank packs its `(hf_name, tensor)` stream into buckets of about `bucket_bytes`; a receiver cuts them back
into named views for vLLM's weight loaders. This module also holds the shared-memory transport (a /dev/shm file per
bucket, mapped without a copy); collective.py the broadcast one.
"""
from __future__ import annotations

import os
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

_ALIGN = 64  # every tensor starts on a 64-byte boundary so that views of any dtype are aligned


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # torch dtype name without the "torch." prefix
    shape: tuple[int, ...]
    offset: int


@dataclass(frozen=True)
class BucketSpec:
    """Where a bucket lives and how to cut it back into named tensors."""

    path: str
    nbytes: int
    entries: tuple[TensorEntry, ...]

    def to_wire(self) -> list:
        """Plain lists for vLLM's RPC serializer, which turns dataclasses into dicts."""
        return [self.path, self.nbytes, entries_to_wire(self.entries)]

    @classmethod
    def from_wire(cls, wire: list) -> BucketSpec:
        path, nbytes, entries = wire
        return cls(path, nbytes, entries_from_wire(entries))


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.path.expanduser("~"), ".cache")


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _map_file(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def bucket_layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[tuple[TensorEntry, ...], int]:
    """Where each tensor goes in the bucket's flat buffer, and the buffer's size in bytes."""
    entries, offset = [], 0
    for name, tensor in tensors:
        entries.append(TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
    return tuple(entries), max(offset, _ALIGN)


def pack_bucket(buffer: torch.Tensor, entries: tuple[TensorEntry, ...],
                tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Copy the tensors (any device) into a flat uint8 `buffer` laid out by `bucket_layout`."""
    for entry, (_, tensor) in zip(entries, tensors):
        nbytes = tensor.numel() * tensor.element_size()
        target = buffer[entry.offset:entry.offset + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor.detach())


def unpack_bucket(buffer: torch.Tensor, entries: tuple[TensorEntry, ...]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the bucket's named tensors as views of the flat uint8 `buffer` (no copy)."""
    for entry in entries:
        dtype = getattr(torch, entry.dtype)
        numel = 1
        for size in entry.shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        yield entry.name, buffer[entry.offset:entry.offset + nbytes].view(dtype).view(entry.shape)


def entries_to_wire(entries: tuple[TensorEntry, ...]) -> list:
    """Plain lists for vLLM's RPC serializer, which turns dataclasses into dicts."""
    return [[e.name, e.dtype, list(e.shape), e.offset] for e in entries]


def entries_from_wire(wire: list) -> tuple[TensorEntry, ...]:
    return tuple(TensorEntry(n, d, tuple(s), o) for n, d, s, o in wire)


def write_bucket(tensors: list[tuple[str, torch.Tensor]], prefix: str) -> BucketSpec:
    """Write tensors (any device) into a new shared-memory file and return its spec. The caller deletes it with
    `release_bucket` once every engine has loaded it."""
    entries, nbytes = bucket_layout(tensors)
    path = os.path.join(_shm_dir(), f"{prefix}-{uuid.uuid4().hex}.bucket")
    pack_bucket(_map_file(path, nbytes), entries, tensors)
    return BucketSpec(path=path, nbytes=nbytes, entries=entries)


def read_bucket(spec: BucketSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the bucket's named tensors as views of the mapped file (valid while the file exists)."""
    return unpack_bucket(_map_file(spec.path, spec.nbytes), spec.entries)


def release_bucket(spec: BucketSpec) -> None:
    """Delete the bucket's file (mapped views stay valid until dropped; the memory is freed then)."""
    try:
        os.unlink(spec.path)
    except FileNotFoundError:
        pass


def iter_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group a stream of named tensors into lists of about `bucket_bytes` (a larger tensor forms its own bucket).
    The stream is consumed lazily, so a layer-by-layer export never holds more than one bucket at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket
