"""Check a multi-node launch before a long run: torchrun rendezvous, a collective across every rank, and the Ray
cluster the trainer will place its rollout engines on.

    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        examples/torchrun/check_cluster.py --out logs/cluster.json
    TRAIN_ENTRY="examples/torchrun/check_cluster.py --out logs/cluster.json" sbatch examples/slurm/train_2nodes.sbatch

Every rank contributes its rank to an all-reduce (the sum must be world*(world-1)/2) and its host name to an
all-gather; rank 0 then connects to Ray at RAY_ADDRESS (when set), counts the alive nodes and their GPUs, and writes
the findings as JSON. Uses NCCL on GPUs and gloo otherwise, like the trainer.

`--wait-for-signal S` then keeps every rank up for S seconds; a rank records `<out>.rank<R>.waiting` once it handles
SIGTERM, and a rank that receives SIGTERM (what the SLURM launcher forwards on preemption) records
`<out>.rank<R>.sigterm` and exits, which shows the signal reaches every rank.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def ray_cluster_summary(address: str) -> dict:
    """Alive nodes of the Ray cluster at `address` and their GPU/CPU totals."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        alive = [node for node in ray.nodes() if node["Alive"]]
        return {"address": address, "alive_nodes": len(alive),
                "node_ips": sorted(node["NodeManagerAddress"] for node in alive),
                "gpus": ray.cluster_resources().get("GPU", 0.0), "cpus": ray.cluster_resources().get("CPU", 0.0)}
    finally:
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--out", default=None, help="rank 0 writes the findings here as JSON")
    parser.add_argument("--wait-for-signal", type=float, default=0.0, metavar="S",
                        help="stay up S seconds after the checks; record SIGTERM per rank next to --out")
    args = parser.parse_args()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if backend == "nccl" else torch.device("cpu")
    total = torch.tensor([float(rank)], device=device)
    dist.all_reduce(total)
    hosts: list = [None] * world
    dist.all_gather_object(hosts, {"rank": rank, "host": socket.gethostname(), "node": os.environ.get("SLURM_NODEID"),
                                   "local_rank": int(os.environ["LOCAL_RANK"]), "master": os.environ["MASTER_ADDR"]})
    expected = world * (world - 1) / 2
    if total.item() != expected:
        raise RuntimeError(f"all_reduce gave {total.item()}, expected {expected}: the collective is broken")
    if rank == 0:
        findings = {"backend": backend, "world_size": world, "all_reduce_sum": total.item(), "ranks": hosts}
        if os.environ.get("RAY_ADDRESS"):
            findings["ray"] = ray_cluster_summary(os.environ["RAY_ADDRESS"])
        text = json.dumps(findings, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text)
    dist.barrier()
    if args.wait_for_signal > 0:
        wait_for_sigterm(rank, args.wait_for_signal, args.out)
    dist.destroy_process_group()


def wait_for_sigterm(rank: int, seconds: float, out: str | None) -> None:
    """Sleep up to `seconds`; on SIGTERM write `<out>.rank<R>.sigterm` and exit with status 0. `<out>.rank<R>.waiting`
    says the handler is in place (so a signal sent from then on is recorded)."""
    def record(signum: int, _frame) -> None:
        if out:
            Path(f"{out}.rank{rank}.sigterm").write_text(str(signum))
        sys.exit(0)

    signal.signal(signal.SIGTERM, record)
    if out:
        Path(f"{out}.rank{rank}.waiting").touch()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
