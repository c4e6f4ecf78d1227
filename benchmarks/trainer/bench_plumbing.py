"""Rank-0 plumbing time of one training step: kept groups -> step batch -> broadcast -> packed sequences.

A synthetic DAPO-like step (issue 14): `--prompts` prompts x `--n` samples, `--prompt-len`-token prompts, log-normal
response lengths (mean about `--mean-response` tokens, capped at `--max-response`), engine log-probs per token. Two
gloo processes on loopback play rank 0 and one receiving rank; rank 0 times `make_step_batch`, `broadcast_batch` and
`prepare_sequences` (the length checks every rank does before the log-prob passes) for `--repeats` steps of the same
batch and prints one JSON line with every step's times, their median and their maximum (a step whose fresh buffers
are first touched pays ~0.4 s of page faults, one that reuses freed memory does not). Each
group's lists are first converted to tensors as the accumulator does when the group arrives (`ScoredGroup.ragged`,
while generation still runs); that time is reported apart (`on_arrival_s`, the sum over all groups). Wall times and
rank 0's CPU time (`cpu_*`, process time: what the step costs without the other jobs of a shared machine) are both
reported.

    python benchmarks/trainer/bench_plumbing.py            # 512 x 16 x (512 + up to 8k), about 22M tokens
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def synthetic_groups(args: argparse.Namespace) -> list:
    """Kept groups as the controller produces them (Python lists from the engine)."""
    from megatron_cpo.trainer.driver.accumulator import ScoredGroup

    rng = np.random.default_rng(0)
    sigma = 0.8
    mu = math.log(args.mean_response) - sigma * sigma / 2  # log-normal with the requested mean before the cap
    groups = []
    for seq in range(args.prompts):
        lengths = np.minimum(rng.lognormal(mu, sigma, args.n).astype(int) + 1, args.max_response)
        responses = [rng.integers(3, 150_000, int(n)).tolist() for n in lengths]
        groups.append(ScoredGroup(
            seq=seq, record=None, prompt_token_ids=rng.integers(3, 150_000, args.prompt_len).tolist(),
            response_token_ids=responses, rollout_log_probs=[(-rng.random(len(r))).tolist() for r in responses],
            truncated=torch.tensor(lengths >= args.max_response), scores=torch.zeros(args.n),
            acc=torch.zeros(args.n)))
    return groups


def run(rank: int, world: int, port: int, args: argparse.Namespace, queue) -> None:
    from megatron_cpo.trainer.driver import batching
    from megatron_cpo.trainer.workers import collectives, policy_update

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = synthetic_groups(args) if rank == 0 else None
    arrival = time.perf_counter()
    for group in groups or []:
        group.ragged()
    on_arrival = time.perf_counter() - arrival
    timings = []
    for _ in range(args.repeats):
        dist.barrier()
        cpu_start = time.process_time()
        start = time.perf_counter()
        batch = batching.make_step_batch(groups, 1.0) if rank == 0 else None
        built, cpu_built = time.perf_counter(), time.process_time()
        batch = collectives.broadcast_batch(batch)
        sent, cpu_sent = time.perf_counter(), time.process_time()
        seqs, rollout_log_probs = policy_update.prepare_sequences(batch, pad_token_id=0, width=args.max_response)
        packed, cpu_packed = time.perf_counter(), time.process_time()
        timings.append({"make_step_batch_s": built - start, "broadcast_s": sent - built, "pack_s": packed - sent,
                        "total_s": packed - start, "cpu_make_step_batch_s": cpu_built - cpu_start,
                        "cpu_broadcast_s": cpu_sent - cpu_built, "cpu_total_s": cpu_packed - cpu_start})
        del batch, rollout_log_probs
    if rank == 0:
        tokens = int(seqs.lengths().sum())
        totals = [t["total_s"] for t in timings]
        queue.put({"on_arrival_s": on_arrival, "total_s_median": statistics.median(totals), "total_s_max": max(totals),
                   "steps": timings, "rows": seqs.rows, "real_tokens": tokens,
                   "real_over_padded": tokens / (seqs.rows * int(seqs.lengths().max()))})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--mean-response", type=int, default=2600)
    parser.add_argument("--max-response", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=5, help="steps timed, one after another in one process")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=run, args=(rank, 2, port, args, queue)) for rank in range(2)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    def rounded(value):
        if isinstance(value, dict):
            return {k: rounded(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rounded(v) for v in value]
        return round(value, 3) if isinstance(value, float) else value
    print(json.dumps({**vars(args), **rounded(result)}))


if __name__ == "__main__":
    main()
