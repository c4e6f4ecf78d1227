"""The kernel benchmark grid of benchmarks/kernels/README.md on the device, within a time budget.

Each cell is `benchmarks/kernels/bench_logprobs.py`'s `measure` (best-of-`iters` forward and forward + backward
time, TFLOPS over 2NHV / 6NHV, allocator peak above the inputs against the float32 logits). The cells run in two
passes so that the comparisons the targets are about come first: pass 1 is cuBLAS `hidden @ weight.T` (`matmul`),
our fused linear kernel and Liger's fused linear cross entropy (the peer, when `liger_kernel` imports) over the whole
grid; pass 2 adds the plain torch paths and the logits kernel. A cell that would start after the deadline is recorded
as skipped. Liger computes its gradients inside forward, so compare its `fwd+bwd ms`, not its `bwd ms`.

    python -m benchmarks.gpu.kernel_grid --out grid.jsonl
"""
from __future__ import annotations

import argparse
import importlib.util
import time
from dataclasses import asdict

import torch

from benchmarks.gpu.report import append_record
from benchmarks.kernels.bench_logprobs import GPU_SIZES, Result, measure

PASS_1 = ["matmul", "fused_linear", "liger_linear"]
PASS_2 = ["torch_linear", "fused_logits", "torch_logits", "verl_linear"]
TINY_SIZES = [(64, 32, 1000)]
PEERS = {"liger_linear": "liger_kernel", "verl_linear": "verl"}


def cells(sizes: list[tuple[int, int, int]], methods_first: list[str], methods_then: list[str]
          ) -> list[tuple[str, tuple[int, int, int]]]:
    """(method, size) in the order they run: the first method list over every size, then the second."""
    return [(m, s) for methods in (methods_first, methods_then) for s in sizes for m in methods]


def add_ratios(records: list[dict]) -> list[dict]:
    """Each linear method's forward and backward TFLOPS as a fraction of cuBLAS forward TFLOPS at the same shape,
    and forward + backward time."""
    matmul = {(r["n"], r["h"], r["v"]): r.get("forward_tflops") for r in records if r.get("method") == "matmul"}
    for r in records:
        base = matmul.get((r.get("n"), r.get("h"), r.get("v")))
        for key in ("forward", "backward"):
            value = r.get(f"{key}_tflops")
            r[f"{key}_vs_cublas"] = value / base if value is not None and base else None
        fwd, bwd = r.get("forward_ms"), r.get("backward_ms")
        r["fwd_bwd_ms"] = fwd + bwd if fwd is not None and bwd is not None else None
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="append one JSON line per cell here")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="one small size, CPU methods (the CPU smoke test)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--deadline", type=float, default=float("inf"), help="unix time to stop starting cells")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    sizes = TINY_SIZES if args.tiny else GPU_SIZES
    first, then = (PASS_1, PASS_2) if device.type == "cuda" else (["matmul", "fused_linear"],
                                                                   ["torch_linear", "fused_logits", "torch_logits"])
    for method, size in cells(sizes, first, then):
        base = {"method": method, "n": size[0], "h": size[1], "v": size[2], "device": str(device)}
        peer = PEERS.get(method)
        if peer and importlib.util.find_spec(peer) is None:
            append_record(args.out, {**base, "status": "skipped", "note": f"{peer} not importable"})
            continue
        if time.time() > args.deadline:
            append_record(args.out, {**base, "status": "skipped", "note": "time budget"})
            continue
        start = time.perf_counter()
        try:
            result = measure(method, *size, device, args.warmup, args.iters, backward=True)
            record = {**asdict(result), "status": "ok"}
        except Exception as error:  # noqa: BLE001  (OOM, Triton out of resources, peer API drift: keep going)
            record = {**asdict(Result(method, *size, str(device))), "status": "failed",
                      "note": f"{type(error).__name__}: {error}"[:300]}
        record["seconds"] = time.perf_counter() - start
        append_record(args.out, record)
        print(record, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
