"""Time CPO's hint MI signals (plain vectorised torch) on [responses, T] batches, next to one log-prob pass.

    python benchmarks/kernels/bench_hint_signals.py --sizes 256x4096,512x8192
"""
from __future__ import annotations

import argparse
import time

import torch

from megatron_cpo.kernels import hint_mi_signals


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_hint_signals(n: int, t: int, device: torch.device, iters: int) -> float:
    """Best (minimum) milliseconds of ``hint_mi_signals`` on random float32 inputs of shape [n, t]."""
    gen = torch.Generator(device=device).manual_seed(0)
    lp = -torch.rand(n, t, device=device, generator=gen) * 5
    lp_h = -torch.rand(n, t, device=device, generator=gen) * 5
    entropy = torch.rand(n, t, device=device, generator=gen) * 4
    mask = torch.rand(n, t, device=device, generator=gen) > 0.2
    hint_mi_signals(lp, lp_h, entropy, mask)
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        hint_mi_signals(lp, lp_h, entropy, mask)
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default="256x4096,512x8192", help="comma-separated NxT")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print("| N | T | tokens | device | hint_mi_signals ms | ns / token |\n|---|---|---|---|---|---|")
    for size in args.sizes.split(","):
        n, t = (int(x) for x in size.split("x"))
        ms = time_hint_signals(n, t, device, args.iters)
        print(f"| {n} | {t} | {n * t} | {device} | {ms:.1f} | {ms * 1e6 / (n * t):.1f} |")


if __name__ == "__main__":
    main()
