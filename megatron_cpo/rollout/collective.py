"""A weight-sync process group between one trainer sending rank (rank 0) and every engine worker (ranks 1..).

Built over a TCPStore the sender hosts, beside both sides' default groups; members announce themselves first, so a
missing one is reported by rank after `timeout_s` instead of hanging (docs/rollout.md, "The weight group").
"""
from __future__ import annotations

import datetime
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_cpo import platform

_POLL_S = 1.0  # how often a joining member re-checks who is missing (and whether the caller gave up)


class WeightGroupJoinError(RuntimeError):
    """A weight-sync group could not be formed: a member never joined, or the store was unreachable."""


def host_weight_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The sending rank's store, listening on a port the OS picks (read it from `.port`)."""
    return dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def connect_weight_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """An engine worker's connection to the sending rank's store; a clear error when it cannot be reached."""
    try:
        return dist.TCPStore(host, port, is_master=False, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=timeout_s))
    except dist.DistError as err:
        raise WeightGroupJoinError(
            f"cannot reach the weight-sync store at {host}:{port} within {timeout_s}s ({err}); check that this "
            "engine's node can reach the trainer's sending rank on that address (firewall, GLOO_SOCKET_IFNAME / "
            "NCCL_SOCKET_IFNAME) or raise actor_rollout_ref.rollout.weight_sync_timeout_s") from err


class WeightGroup:
    """One member's handle on a weight-sync group: broadcast flat byte buffers from rank 0, then close."""

    def __init__(self, store: dist.Store, name: str, address: str, rank: int, world_size: int,
                 timeout_s: float, check_abort: Callable[[], str | None] | None = None) -> None:
        """Join the group `name` over `store` (hosted at `address`, "host:port") as `rank` of `world_size`.
        Blocks until every member joined; `check_abort`, polled while waiting, returns a reason to give up early
        (e.g. an engine whose join call already failed)."""
        self.name, self.address, self.rank, self.world_size = name, address, rank, world_size
        self.device = platform.device()
        self._store = store  # keeps a hosted store's server alive as long as the group
        group_store = dist.PrefixStore(f"megatron_cpo-weights/{name}", store)
        self._rendezvous(group_store, timeout_s, check_abort)
        timeout = datetime.timedelta(seconds=timeout_s)
        self._backend = _make_backend(dist.PrefixStore("backend", group_store), rank, world_size, timeout)
        probe = torch.ones(1, device=self.device)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._backend.allreduce([probe], opts).wait()
        if int(probe.item()) != world_size:
            raise WeightGroupJoinError(f"weight-sync group {name!r} at {address}: the warm-up all-reduce counted "
                                       f"{int(probe.item())} members instead of {world_size}")

    def _rendezvous(self, store: dist.Store, timeout_s: float, check_abort: Callable[[], str | None] | None) -> None:
        keys = [f"joined/{rank}" for rank in range(self.world_size)]
        store.set(keys[self.rank], "1")
        deadline = time.monotonic() + timeout_s
        while True:
            wait_s = max(0.001, min(_POLL_S, deadline - time.monotonic()))
            try:
                store.wait(keys, datetime.timedelta(seconds=wait_s))
                return
            except dist.DistNetworkError as err:
                raise WeightGroupJoinError(
                    f"weight-sync group {self.name!r}: rank {self.rank} lost the store at {self.address} while "
                    f"waiting for the other members ({err}); the sending rank gave up or died (see its error)") from err
            except dist.DistStoreError:
                pass
            reason = check_abort() if check_abort is not None else None
            if reason is None and time.monotonic() < deadline:
                continue
            missing = [rank for rank, key in enumerate(keys) if not store.check([key])]
            raise WeightGroupJoinError(
                f"weight-sync group {self.name!r} at {self.address}: ranks {missing} of {self.world_size} never "
                f"joined{f' ({reason})' if reason else f' within {timeout_s}s'}; rank 0 is the trainer's sending "
                f"rank, ranks 1.. the engine workers. Check that every engine node can reach {self.address} "
                "(firewall, GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME) and that the engines are alive, or raise "
                "actor_rollout_ref.rollout.weight_sync_timeout_s")

    def broadcast(self, buffer: torch.Tensor) -> None:
        """Send (rank 0) or receive (every other rank) a flat buffer in place; it must be on `self.device`."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._backend.broadcast([buffer], opts).wait()

    def close(self) -> None:
        """Tear the backend down and drop the store connection (the sender's also stops its server)."""
        if self._backend is not None:
            self._backend.shutdown()
            self._backend = None
        self._store = None


def _make_backend(store: dist.Store, rank: int, world_size: int, timeout: datetime.timedelta):
    """The platform's backend built directly over the store (no default process group involved)."""
    if platform.backend() == "nccl":
        from torch.distributed import ProcessGroupNCCL

        options = ProcessGroupNCCL.Options()
        options._timeout = timeout
        return ProcessGroupNCCL(store, rank, world_size, options)
    from torch.distributed import ProcessGroupGloo

    return ProcessGroupGloo(store, rank, world_size, timeout)
