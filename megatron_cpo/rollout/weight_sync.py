"""Pushing trainer weights into the rollout engines, from one rank or from every pipeline stage.

Protocol:
1. rank 0's `RolloutManager.begin_weight_sync()` opens a reload on every engine; it hands out a `WeightSenderSpec`
   (Ray address, namespace, engine actor names, transport), which rank 0 broadcasts to the other trainer ranks.
2. Every rank that yields tensors (TP rank 0 of each PP stage) runs `WeightSender(spec).send(named_tensors)` (or
   `send_from_pipeline_stages`, which also orders the stages): it packs its own layers into buckets and has every
   engine load each bucket; buckets from different stages may interleave because a layer is finalised once all of
   its tensors arrived, whoever sent them.
3. After a barrier, rank 0's `RolloutManager.finish_weight_sync()` finalises the reload and clears the prefix cache;
   it returns each engine worker's reload report, which `reload_problem` reads (a parameter nothing filled, a tensor
   sent twice).

Transports (`rollout.weight_transport`):
- "shm": buckets are files in /dev/shm that the engine workers map; engines must be on the sending rank's node. All
  stages send at once, and no collective runs between trainer ranks while tensors stream.
- "collective": each sending rank opens a weight-sync group with every engine worker (gloo on CPU, NCCL on GPUs; see
  `collective.py`) once and keeps it; each bucket is broadcast from the sending rank's device. Engines may be on any
  node that reaches the sending rank. Stages send one after another.
- "auto": "collective" when engines may be on another node (see `resolve_weight_transport`), else "shm".
"""
from __future__ import annotations

import atexit
import itertools
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_cpo.rollout.buckets import (
    bucket_layout,
    entries_to_wire,
    iter_buckets,
    pack_bucket,
    release_bucket,
    write_bucket,
)
from megatron_cpo.rollout.collective import WeightGroup, host_weight_store
from megatron_cpo.rollout.types import WeightPushInterruptedError

logger = logging.getLogger(__name__)

WEIGHT_TRANSPORTS = ("auto", "shm", "collective")


@dataclass(frozen=True)
class WeightSenderSpec:
    """Everything a trainer rank needs to reach the engines: picklable, broadcast from rank 0."""

    ray_address: str
    ray_namespace: str
    engine_names: tuple[str, ...]
    bucket_bytes: int
    transport: str = "shm"  # "shm" or "collective" (rank 0 resolves "auto" before broadcasting the spec)
    workers_per_engine: int = 1  # vLLM workers per engine (its tensor_parallel_size): group ranks per engine
    timeout_s: float = 300.0  # collective group join and per-broadcast timeout; the longest wait for one bucket's load
    health_timeout_s: float = 30.0  # how long an engine that failed a load may take to answer its health check


class WeightSender:
    """Streams one rank's HF-named tensors into every live engine, bucket by bucket. Over shared memory an engine
    that does not load a bucket within `timeout_s`, or fails and is unhealthy, is dropped from the rest of this
    push (`dropped` says why, a warning names it once) and the others complete it; rank 0's manager gives it up
    when it finishes the push (finish_weight_sync health-checks the engines first)."""

    def __init__(self, spec: WeightSenderSpec, engine_handles: list | None = None) -> None:
        import ray

        self.spec = spec
        if engine_handles is None:
            if not ray.is_initialized():
                ray.init(address=spec.ray_address, namespace=spec.ray_namespace, log_to_driver=False)
            engine_handles = [ray.get_actor(name, namespace=spec.ray_namespace) for name in spec.engine_names]
        self._engines = dict(zip(spec.engine_names, engine_handles))  # those still in this push
        self.dropped: dict[str, str] = {}  # engine name -> why it left this push

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Load the tensors into every engine; returns bytes, seconds, buckets and tensors sent by this rank."""
        if self.spec.transport == "collective":
            return self._send_collective(named_tensors)
        return self._send_shm(named_tensors)

    def _send_shm(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """A bucket is written once to /dev/shm and loaded by all engines in parallel; the next bucket is packed
        while the engines load, so at most two buckets live in shared memory at a time."""
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
                loads = {name: engine.load_weight_bucket.remote(spec) for name, engine in self._engines.items()}
                pending = (spec, loads)
                num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
                num_buckets += 1
                num_tensors += len(bucket)
            if pending is not None:
                self._wait(*pending)
                pending = None
        finally:
            if pending is not None:
                loads = list(pending[1].values())
                ray.wait(loads, num_returns=len(loads), timeout=min(60.0, self.spec.timeout_s))
                release_bucket(pending[0])
        return {"bytes": float(num_bytes), "seconds": time.perf_counter() - start, "buckets": float(num_buckets),
                "tensors": float(num_tensors), "engines_dropped": float(len(self.dropped))}

    def _wait(self, spec, loads: dict) -> None:
        """Wait (at most `timeout_s`) for every engine's load of one bucket, then free it. An engine that did not
        load it in time, or failed and is unhealthy, leaves this push; a healthy engine's error is raised."""
        import ray

        try:
            refs = list(loads.values())
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=self.spec.timeout_s)
            for name, ref in loads.items():
                if ref not in done:
                    self._drop(name, f"did not load a weight bucket within actor_rollout_ref.rollout."
                                     f"weight_sync_timeout_s={self.spec.timeout_s:g}s")
                    continue
                try:
                    ray.get(ref)
                except ray.exceptions.RayError as err:
                    if self._is_healthy(name):
                        raise
                    lines = [line for line in str(err).splitlines() if line.strip()]
                    self._drop(name, f"failed to load a weight bucket: {lines[-1] if lines else type(err).__name__}")
        finally:
            release_bucket(spec)

    def _is_healthy(self, name: str) -> bool:
        import ray

        try:
            ray.get(self._engines[name].is_healthy.remote(), timeout=self.spec.health_timeout_s)
            return True
        except ray.exceptions.RayError:
            return False

    def _drop(self, name: str, why: str) -> None:
        self._engines.pop(name, None)
        self.dropped[name] = why
        logger.warning("rollout engine %s left this weight push (%d engines complete it): %s", name,
                       len(self._engines), why)

    def _send_collective(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Each bucket is packed into one flat buffer on this rank's device and broadcast over the weight-sync group
        to every engine worker, which loads it in place. The group is opened on the first sync and kept."""
        import ray

        start = time.perf_counter()
        group = _open_groups.get(self.spec)
        group_init_s = 0.0
        engines = list(self._engines.values())
        if group is None:
            group = _open_groups.open(self.spec, engines)
            group_init_s = time.perf_counter() - start
        num_bytes = num_buckets = num_tensors = 0
        buffer = torch.empty(0, dtype=torch.uint8, device=group.device)
        for bucket in iter_buckets(named_tensors, self.spec.bucket_bytes):
            entries, nbytes = bucket_layout(bucket)
            if buffer.numel() < nbytes:
                buffer = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=group.device)
            pack_bucket(buffer[:nbytes], entries, bucket)
            loads = [engine.receive_weight_bucket.remote(group.name, entries_to_wire(entries), nbytes)
                     for engine in engines]
            try:
                group.broadcast(buffer[:nbytes])
                ray.get(loads, timeout=self.spec.timeout_s)
            except BaseException as err:
                _open_groups.close(self.spec)
                raise WeightPushInterruptedError(
                    f"weight-sync broadcast of bucket {num_buckets} over group {group.name!r} ({group.address}) "
                    f"failed: {err}; {_engine_errors(loads)}the group is closed and the next sync opens a new one "
                    "with the live engines") from err
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
            num_tensors += len(bucket)
        return {"bytes": float(num_bytes), "seconds": time.perf_counter() - start, "buckets": float(num_buckets),
                "tensors": float(num_tensors), "group_init_seconds": group_init_s}


def _engine_errors(refs: list) -> str:
    """The first error an engine already reported among `refs`, as a sentence ("" when none did). Every finished
    ref is read, so Ray does not log the others' errors as unhandled."""
    import ray

    done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
    errors = []
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            lines = [line for line in str(err).splitlines() if line.strip()]
            errors.append(f"engine {refs.index(ref)} reported: {lines[-1] if lines else type(err).__name__}; ")
    return errors[0] if errors else ""


class _SenderGroups:
    """This process's open weight-sync groups, one per set of engines it sends to, kept across syncs."""

    def __init__(self) -> None:
        self._groups: dict[tuple, tuple[WeightGroup, list]] = {}
        self._atexit_registered = False

    @staticmethod
    def _key(spec: WeightSenderSpec) -> tuple:
        return spec.ray_namespace, spec.engine_names, spec.workers_per_engine

    def get(self, spec: WeightSenderSpec) -> WeightGroup | None:
        entry = self._groups.get(self._key(spec))
        return entry[0] if entry else None

    def open(self, spec: WeightSenderSpec, engines: list) -> WeightGroup:
        """Host a store on this node, ask every engine to join (asynchronously) and join as rank 0."""
        import ray

        self.close_all(engine_names=spec.engine_names)  # a group over an older set of these engines is stale
        host = ray.util.get_node_ip_address()
        store = host_weight_store(host, spec.timeout_s)
        name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        world_size = 1 + len(engines) * spec.workers_per_engine
        joins = [engine.join_weight_group.remote(name, host, store.port, 1 + index * spec.workers_per_engine,
                                                 world_size, spec.timeout_s) for index, engine in enumerate(engines)]
        try:
            group = WeightGroup(store, name, f"{host}:{store.port}", 0, world_size, spec.timeout_s,
                                check_abort=lambda: _engine_errors(joins).rstrip("; ") or None)
        except BaseException:
            # The engines that joined give up on their own timeout; collect their (expected) errors so that Ray
            # does not report them as unhandled.
            ready, _ = ray.wait(joins, num_returns=len(joins), timeout=spec.timeout_s + 10)
            _engine_errors(ready)
            raise
        ray.get(joins)
        if not self._atexit_registered:  # registered after ray.init, so it runs before Ray's own exit hook
            atexit.register(self.close_all)
            self._atexit_registered = True
        self._groups[self._key(spec)] = (group, engines)
        return group

    def close(self, spec: WeightSenderSpec) -> None:
        entry = self._groups.pop(self._key(spec), None)
        if entry is not None:
            _close_group(*entry)

    def close_all(self, engine_names: Iterable[str] | None = None) -> None:
        """Close the groups that reach any of `engine_names` (all groups when None)."""
        names = None if engine_names is None else set(engine_names)
        for key in list(self._groups):
            if names is None or names & set(key[1]):
                _close_group(*self._groups.pop(key))


def _close_group(group: WeightGroup, engines: list) -> None:
    """Engines leave first (best effort: some may be dead), then this rank closes its side and its store."""
    import ray

    if ray.is_initialized():
        leaves = [engine.leave_weight_group.remote(group.name) for engine in engines]
        ray.wait(leaves, num_returns=len(leaves), timeout=30)
    group.close()


_open_groups = _SenderGroups()


def close_weight_groups(engine_names: Iterable[str] | None = None) -> None:
    """Close this process's collective weight-sync groups (those reaching `engine_names`, or all). Safe to call
    when none is open; also runs at interpreter exit."""
    _open_groups.close_all(engine_names)


def reload_problem(reports: dict[str, list[dict]]) -> str | None:
    """One sentence naming what a push got wrong, from the engines' reload reports (`finish_weight_sync`): model
    parameters that no received tensor filled (a sender left them out), tensor names that arrived more than once
    (two senders exported the same tensor), or a prefix cache vLLM did not drop (it would serve keys and values of
    the old weights); None when every engine received each parameter exactly once and dropped its cache."""
    for engine, worker_reports in reports.items():
        for report in worker_reports:
            if report.get("prefix_cache_reset") is False:
                return (f"rollout {engine} kept its prefix cache after the push (vLLM resets it only when no request "
                        "holds cached blocks): its cached prompts would be served with keys and values of the old "
                        "weights; push weights only while the engines are idle")
            for key, what in (("missing", "received nothing for"), ("repeated", "received more than once")):
                names = report.get(key) or []
                if names:
                    return (f"rollout {engine} {what} {len(names)} weight(s) in this push: {names[:6]}"
                            f"{' ...' if len(names) > 6 else ''} ({report.get('tensors', 0)} tensors arrived); the "
                            "trainer's export (models/weight_mapping.py iter_hf_weights) and the engine's model "
                            "disagree on which tensors exist or which stage sends them")
    return None


def resolve_weight_transport(choice: str) -> str:
    """"shm" or "collective" for a configured `weight_transport`. "auto" picks the collective transport when the
    engines may be on another node than a sending rank: the Ray cluster has more than one live node, or the trainer
    spans more than one node (torchrun's WORLD_SIZE > LOCAL_WORLD_SIZE); otherwise shared memory, the faster on one
    node."""
    if choice not in WEIGHT_TRANSPORTS:
        raise ValueError(f"weight_transport={choice!r}; use one of {', '.join(WEIGHT_TRANSPORTS)}")
    if choice != "auto":
        return choice
    import ray

    ray_nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer_nodes_multi = world_size > int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    return "collective" if ray_nodes > 1 or trainer_nodes_multi else "shm"


def send_from_pipeline_stages(spec, named_tensors: Iterable[tuple[str, torch.Tensor]],
                              stage: int, num_stages: int) -> dict[str, float]:
    """Collective over the default process group: every trainer rank calls it with its own export stream (which its
    TP group iterates in step). Ranks whose stream yields tensors send them; returns this rank's send metrics.
    `spec` is a `WeightSenderSpec` (Ray engines) or a spec with `make_sender()` (HTTP servers, `server_client`).

    With shared memory all stages send at once. With the collective transport the stages take turns (a barrier
    between turns): an engine worker runs one RPC at a time, so two senders broadcasting at once could each wait on
    an engine that is busy receiving from the other.
    """
    turns = range(num_stages) if spec.transport == "collective" else (stage,)
    sent = {"bytes": 0.0, "seconds": 0.0, "buckets": 0.0, "tensors": 0.0}
    for turn in turns:
        if turn == stage:
            tensors = iter(named_tensors)
            first = next(tensors, None)
            if first is not None:
                sender = WeightSender(spec) if isinstance(spec, WeightSenderSpec) else spec.make_sender()
                sent = sender.send(itertools.chain([first], tensors))
        if spec.transport == "collective" and dist.is_initialized() and dist.get_world_size() > 1:
            dist.barrier()
    return sent

