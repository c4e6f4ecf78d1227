"""Benchmark per-token log-prob + entropy: fused kernels vs materialised logits (and verl / Liger where importable).

On CUDA (the issue's grid): N in {4k, 16k, 32k}, H in {2048, 4096}, V in {128256, 152064}, bf16; time (best of
``--iters``), effective TFLOPS (2NHV forward, 6NHV backward), peak extra memory (allocator peak above the inputs,
output gradients included) as a fraction of the float32 logits, and the cuBLAS bf16 matmul of the same shape.
On CPU the same methods without verl/Liger, at reduced sizes; memory is the rise of the process's peak RSS
(``ru_maxrss``), so every measurement runs in a fresh subprocess (with glibc's mmap threshold fixed at 1 MiB).

    python benchmarks/kernels/bench_logprobs.py                      # grid of the device in use
    python benchmarks/kernels/bench_logprobs.py --sizes 1024x256x32768 --methods fused_linear,torch_linear
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy
from megatron_cpo.kernels.reference import materialized_linear_log_probs_and_entropy, materialized_log_probs_and_entropy

GPU_SIZES = [(n, h, v) for n in (4096, 16384, 32768) for h in (2048, 4096) for v in (128256, 152064)]
CPU_SIZES = [(512, 256, 32768), (512, 128, 128256)]


@dataclass
class Inputs:
    hidden: torch.Tensor
    weight: torch.Tensor
    targets: torch.Tensor
    logits: torch.Tensor | None = None


@dataclass
class Result:
    method: str
    n: int
    h: int
    v: int
    device: str
    forward_ms: float | None = None
    backward_ms: float | None = None
    forward_tflops: float | None = None
    backward_tflops: float | None = None
    peak_extra_mib: float | None = None
    extra_over_fp32_logits: float | None = None
    error: str | None = None


def _verl(inputs: Inputs):
    from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

    return linear_cross_entropy(inputs.hidden, inputs.weight, inputs.targets, 1.0, "none")


def _liger(inputs: Inputs):
    from liger_kernel.transformers.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss(reduction="none")(inputs.weight, inputs.hidden, inputs.targets)
    return (loss[0] if isinstance(loss, tuple) else loss).neg(), None


# name -> (needs materialised logits as input, forward returning (log_probs, entropy-or-None))
METHODS: dict[str, tuple[bool, Callable[[Inputs], tuple]]] = {
    "fused_linear": (False, lambda x: linear_log_probs_and_entropy(x.hidden, x.weight, x.targets)),
    "torch_linear": (False, lambda x: materialized_linear_log_probs_and_entropy(x.hidden, x.weight, x.targets)),
    "fused_logits": (True, lambda x: log_probs_and_entropy(x.logits, x.targets)),
    "torch_logits": (True, lambda x: materialized_log_probs_and_entropy(x.logits, x.targets)),
    "matmul": (False, lambda x: (x.hidden @ x.weight.T, None)),
    "verl_linear": (False, _verl),
    "liger_linear": (False, _liger),
}
CPU_METHODS = ["fused_linear", "torch_linear", "fused_logits", "torch_logits", "matmul"]
GPU_METHODS = list(METHODS)


def _make_inputs(n: int, h: int, v: int, device: torch.device, with_logits: bool) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(0)
    hidden = torch.empty(n, h, dtype=torch.bfloat16, device=device).normal_(generator=gen)
    weight = torch.empty(v, h, dtype=torch.bfloat16, device=device).normal_(std=h**-0.5, generator=gen)
    targets = torch.randint(0, v, (n,), device=device, generator=gen)
    logits = torch.empty(n, v, dtype=torch.bfloat16, device=device).normal_(std=2.0, generator=gen) if with_logits \
        else None
    hidden.requires_grad_()
    weight.requires_grad_()
    if logits is not None:
        logits.requires_grad_()
    return Inputs(hidden, weight, targets, logits)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], object], device: torch.device, warmup: int, iters: int) -> float:
    """Best (minimum) wall time of ``fn`` in milliseconds: the least disturbed by other load on the machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    return min(times)


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def measure(method: str, n: int, h: int, v: int, device: torch.device, warmup: int, iters: int,
            backward: bool) -> Result:
    """Time forward (and forward + backward) of one method at one size; record the peak memory above the inputs."""
    needs_logits, forward = METHODS[method]
    result = Result(method, n, h, v, str(device))
    run_backward = backward and method != "matmul"

    def forward_only(inputs: Inputs) -> None:
        with torch.no_grad():
            forward(inputs)

    def forward_backward(inputs: Inputs) -> None:
        log_probs, entropy = forward(inputs)
        loss = log_probs.float().sum() + (entropy.sum() if entropy is not None else 0.0)
        loss.backward()
        for t in (inputs.hidden, inputs.weight, inputs.logits):
            if t is not None:
                t.grad = None

    tiny = _make_inputs(16, 32, 64, device, needs_logits)  # loads code and libraries before the baseline is taken
    (forward_backward if run_backward else forward_only)(tiny)
    del tiny
    inputs = _make_inputs(n, h, v, device, needs_logits)

    _sync(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if device.type == "cuda" else _peak_bytes(device)
    result.forward_ms = _timed(lambda: forward_only(inputs), device, warmup, iters)
    if run_backward:
        result.backward_ms = _timed(lambda: forward_backward(inputs), device, warmup, iters) - result.forward_ms
    extra = _peak_bytes(device) - base
    flops = 2 * n * h * v
    if not needs_logits:
        result.forward_tflops = flops / result.forward_ms / 1e9
        if run_backward and result.backward_ms > 0:
            result.backward_tflops = 3 * flops / result.backward_ms / 1e9
    result.peak_extra_mib = extra / 2**20
    result.extra_over_fp32_logits = extra / (n * v * 4)
    return result


def _run_isolated(args: argparse.Namespace, method: str, size: tuple[int, int, int]) -> Result:
    """Run one CPU measurement in a fresh interpreter so that ``ru_maxrss`` starts from this measurement's inputs."""
    cmd = [sys.executable, __file__, "--device", "cpu", "--methods", method, "--sizes", "x".join(map(str, size)),
           "--warmup", str(args.warmup), "--iters", str(args.iters), "--threads", str(args.threads), "--child"]
    if args.no_backward:
        cmd.append("--no-backward")
    # A fixed mmap threshold makes glibc return every freed tile to the OS, so peak RSS tracks live memory instead of
    # heap fragments kept from earlier iterations.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return Result(method, *size, "cpu", error=proc.stderr.strip().splitlines()[-1][:200])
    return Result(**json.loads(proc.stdout.strip().splitlines()[-1]))


def _fmt(value: float | None, digits: int = 1) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def markdown(results: list[Result]) -> str:
    header = ("| method | N | H | V | device | fwd ms | fwd TFLOPS | bwd ms | bwd TFLOPS | peak extra MiB "
              "| extra / fp32 logits | note |")
    lines = [header, "|" + "---|" * 12]
    for r in results:
        lines.append(f"| {r.method} | {r.n} | {r.h} | {r.v} | {r.device} | {_fmt(r.forward_ms)} | "
                     f"{_fmt(r.forward_tflops, 3)} | {_fmt(r.backward_ms)} | {_fmt(r.backward_tflops, 3)} | "
                     f"{_fmt(r.peak_extra_mib, 0)} | {_fmt(r.extra_over_fp32_logits, 3)} | {r.error or ''} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", default=None, help="comma-separated NxHxV (default: the device's grid)")
    parser.add_argument("--methods", default=None, help=f"comma-separated subset of {list(METHODS)}")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    args.warmup = args.warmup if args.warmup is not None else (3 if on_gpu else 1)
    args.iters = args.iters if args.iters is not None else (10 if on_gpu else 3)
    torch.set_num_threads(args.threads)
    sizes = ([tuple(int(x) for x in s.split("x")) for s in args.sizes.split(",")] if args.sizes
             else (GPU_SIZES if on_gpu else CPU_SIZES))
    methods = args.methods.split(",") if args.methods else (GPU_METHODS if on_gpu else CPU_METHODS)
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {list(METHODS)}")

    if args.child:
        (size,) = sizes
        print(json.dumps(asdict(measure(methods[0], *size, device, args.warmup, args.iters, not args.no_backward))))
        return
    results = []
    for size in sizes:
        for method in methods:
            if on_gpu:
                try:
                    result = measure(method, *size, device, args.warmup, args.iters, not args.no_backward)
                except (ImportError, RuntimeError, TypeError, ValueError) as exc:  # verl/Liger absent, OOM, API drift
                    result = Result(method, *size, str(device), error=f"{type(exc).__name__}: {exc}"[:200])
                    torch.cuda.empty_cache()
            else:
                result = _run_isolated(args, method, size)
            results.append(result)
            print(markdown([result]).splitlines()[-1], flush=True)
    if on_gpu:
        print(f"\nGPU: {torch.cuda.get_device_name()}")
    print("\n" + markdown(results))
    if args.out:
        with open(args.out, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)


if __name__ == "__main__":
    main()
