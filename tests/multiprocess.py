"""Run a function in N real processes joined by a gloo process group on loopback (for TP/PP tests on CPU)."""
from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    try:
        queue.put((rank, "ok", fn(rank, world_size, *args)))
    except BaseException:  # report every failure to the parent, which re-raises it
        queue.put((rank, "error", traceback.format_exc()))


def run_processes(fn: Callable, world_size: int = 2, *args: Any, timeout: float = 600.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` in `world_size` spawned processes; return their results by rank.

    The environment variables torch.distributed expects (MASTER_ADDR/PORT, RANK, WORLD_SIZE) are set; `fn` calls
    `torch.distributed.init_process_group` itself (or the platform helper does). A failure in any rank raises here
    with that rank's traceback.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank} failed:\n{payload}")
                break
    finally:
        for p in procs:
            p.join(timeout=5 if errors else 60)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]
