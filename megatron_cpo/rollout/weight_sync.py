"""Pushing trainer weights into the rollout engines, from one rank or from every pipeline stage at once.

Protocol (CPU and single-node GPU transport: shared memory):
1. rank 0's `RolloutManager.begin_weight_sync()` opens a reload on every engine; it hands out a `WeightSenderSpec`
   (Ray address, namespace and engine actor names), which rank 0 broadcasts to the other trainer ranks.
2. Every rank that yields tensors (TP rank 0 of each PP stage) runs `WeightSender(spec).send(named_tensors)`: it packs
   its own layers into buckets in /dev/shm and asks each engine to load each bucket; buckets from different stages
   interleave freely because a layer is finalised once all of its tensors arrived, whoever sent them.
3. After a barrier, rank 0's `RolloutManager.finish_weight_sync()` finalises the reload and clears the prefix cache.
No collective is issued between trainer ranks while tensors stream, so the export's own TP/PP collectives can never
be interleaved with ours. Shared memory needs the engines on the sender's node; an NCCL transport for multi-node
GPU clusters is not implemented in this package (it cannot be exercised without GPUs).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterable

import torch

from megatron_cpo.rollout.buckets import iter_buckets, release_bucket, write_bucket


@dataclass(frozen=True)
class WeightSenderSpec:
    """Everything a trainer rank needs to reach the engines: picklable, broadcast from rank 0."""

    ray_address: str
    ray_namespace: str
    engine_names: tuple[str, ...]
    bucket_bytes: int


class WeightSender:
    """Streams one rank's HF-named tensors into every live engine, bucket by bucket."""

    def __init__(self, spec: WeightSenderSpec, engine_handles: list | None = None) -> None:
        import ray

        self.spec = spec
        if engine_handles is None:
            if not ray.is_initialized():
                ray.init(address=spec.ray_address, namespace=spec.ray_namespace, log_to_driver=False)
            engine_handles = [ray.get_actor(name, namespace=spec.ray_namespace) for name in spec.engine_names]
        self._engines = engine_handles

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load the tensors into every engine; returns bytes, seconds, buckets and tensors sent by this rank.

        A bucket is written once and loaded by all engines in parallel; the next bucket is packed while the
        engines load, so at most two buckets live in shared memory at a time.
        """
        import ray

        start = time.perf_counter()
        num_bytes = num_buckets = num_tensors = 0
        pending: tuple | None = None
        try:
            for bucket in iter_buckets(named_tensors, self.spec.bucket_bytes):
                spec = write_bucket(bucket, prefix="megatron_cpo-weights")
                if pending is not None:
                    previous, pending = pending, None
                    try:
                        self._wait(*previous)
                    except BaseException:
                        release_bucket(spec)
                        raise
                loads = [engine.load_weight_bucket.remote(spec) for engine in self._engines]
                pending = (spec, loads)
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
                num_tensors += len(bucket)
            if pending is not None:
                self._wait(*pending)
                pending = None
        finally:
            if pending is not None:
                ray.wait(pending[1], num_returns=len(pending[1]), timeout=60)
                release_bucket(pending[0])
        return {"bytes": float(num_bytes), "seconds": time.perf_counter() - start, "buckets": float(num_buckets),
                "tensors": float(num_tensors)}

    @staticmethod
    def _wait(spec, loads) -> None:
        import ray

        try:
            ray.get(loads)
        finally:
            release_bucket(spec)
