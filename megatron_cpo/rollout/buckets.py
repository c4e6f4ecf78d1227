"""Weight buckets: HF-named tensors packed into flat shared-memory files that engine workers map without a copy.

A sending rank walks its `(hf_name, tensor)` stream, packs tensors into buckets of about `bucket_bytes`, writes each
bucket to a file in /dev/shm (RAM-backed) and hands the engines a small `BucketSpec` (path + tensor table). Each
engine worker maps the file and feeds the views to vLLM's weight loaders, which copy them into the model. Only
the spec travels through Ray; the bytes are written once and read in place by every engine on the node.
"""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Iterable, Iterator

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
        return [self.path, self.nbytes, [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries]]

    @classmethod
    def from_wire(cls, wire: list) -> "BucketSpec":
        path, nbytes, entries = wire
        return cls(path, nbytes, tuple(TensorEntry(n, d, tuple(s), o) for n, d, s, o in entries))


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else os.path.join(os.path.expanduser("~"), ".cache")


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _map_file(path: str, nbytes: int) -> torch.Tensor:
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def write_bucket(tensors: list[tuple[str, torch.Tensor]], prefix: str) -> BucketSpec:
    """Write tensors (any device) into a new shared-memory file and return its spec. The caller deletes it with
    `release_bucket` once every engine has loaded it."""
    entries, offset = [], 0
    for name, tensor in tensors:
        entries.append(TensorEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
        offset = _aligned(offset + tensor.numel() * tensor.element_size())
    path = os.path.join(_shm_dir(), f"{prefix}-{uuid.uuid4().hex}.bucket")
    buffer = _map_file(path, max(offset, _ALIGN))
    for entry, (_, tensor) in zip(entries, tensors):
        nbytes = tensor.numel() * tensor.element_size()
        target = buffer[entry.offset:entry.offset + nbytes].view(tensor.dtype).view(tensor.shape)
        target.copy_(tensor.detach())
    return BucketSpec(path=path, nbytes=max(offset, _ALIGN), entries=tuple(entries))


def read_bucket(spec: BucketSpec) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield the bucket's named tensors as views of the mapped file (valid while the file exists)."""
    buffer = _map_file(spec.path, spec.nbytes)
    for entry in spec.entries:
        dtype = getattr(torch, entry.dtype)
        numel = 1
        for size in entry.shape:
            numel *= size
        nbytes = numel * dtype.itemsize
        yield entry.name, buffer[entry.offset:entry.offset + nbytes].view(dtype).view(entry.shape)


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
