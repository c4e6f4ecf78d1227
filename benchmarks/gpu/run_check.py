"""Run the GPU check's parts within one time budget and write `results.json` and `results.md`.

Parts run in this order, each in its own process with its own budget (the last one gets what is left): kernel
correctness against float64, the core attention against float64 (check_attention.py), the Megatron actor in each mode
(`actor_<mode>`: padded, token budget, packed, fused lm-head, and the token budget on the local attention), the actor's
colocated offload round trip (device -> pinned host -> device, bit-identical), the kernel benchmark grid. A part stops
starting new measurements at its deadline and is killed (its process group) if it overruns; everything it recorded up to
then is kept. `scripts/gpu_check.sh` is the entry point (GPU detection, offline wheels); `--tiny --device cpu` runs the
same parts at tiny shapes on CPU (the CI smoke test).

    python -m benchmarks.gpu.run_check --out runs/gpu_check/now --budget-s 500
"""
from __future__ import annotations

import argparse
import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.gpu.report import Column, environment, fmt, markdown_table, read_records, text, write_results

ROOT = Path(__file__).resolve().parents[2]
GRACE_S = 20.0  # a part stops starting measurements this long before its end, to finish the current one


def _ok(value) -> str:
    return "" if value is None else ("yes" if value else "NO")


@dataclass(frozen=True)
class Part:
    name: str
    module: str
    budget_s: float | None  # None: whatever is left
    columns: list[Column]
    tiny_args: tuple[str, ...] = ("--tiny",)
    extra_args: tuple[str, ...] = field(default=())


KERNEL_COLUMNS: list[Column] = [
    ("backend", "backend", text), ("kernel", "kernel", text), ("dtype", "dtype", text), ("case", "case", text),
    ("N", "n", text), ("H", "h", text), ("V (+pad)", "v", text), ("T", "temperature", fmt(1)),
    ("err log-prob", "err_log_probs", fmt(8)), ("err entropy", "err_entropy", fmt(8)),
    ("err grad input", "err_grad_input", fmt(8)), ("err grad weight", "err_grad_weight", fmt(8)),
    ("torch err grad input", "torch_err_grad_input", fmt(8)),
    ("torch err grad weight", "torch_err_grad_weight", fmt(8)),
    ("tolerance", "tolerance", text), ("pad grad 0", "padding_grad_zero", _ok), ("status", "status", text),
    ("note", "note", text)]
ACTOR_COLUMNS: list[Column] = [
    ("mode", "mode", text), ("attention", "attention", text), ("phase", "phase", text), ("layers", "layers", text),
    ("rows", "rows", text),
    ("real tokens", "real_tokens", text), ("padded positions", "padded_positions", text), ("s", "seconds", fmt(2)),
    ("real tokens/s", "real_tokens_per_s", fmt(0)), ("model TFLOPS (real)", "model_tflops_real", fmt(1)),
    ("MFU real", "mfu_real", fmt(3)), ("MFU padded", "mfu_padded", fmt(3)), ("peak TFLOPS used", "peak_tflops", fmt(0)),
    ("peak GiB", "peak_gib", fmt(2)), ("plan GiB", "plan_memory_gib", fmt(2)),
    ("plan s (MFU 0.3)", "plan_seconds", fmt(2)),
    ("plan real tokens/s", "plan_real_tokens_per_s", fmt(0)), ("status", "status", text), ("note", "note", text)]
GRID_COLUMNS: list[Column] = [
    ("method", "method", text), ("N", "n", text), ("H", "h", text), ("V", "v", text), ("fwd ms", "forward_ms", fmt(2)),
    ("fwd TFLOPS", "forward_tflops", fmt(1)), ("fwd / cuBLAS", "forward_vs_cublas", fmt(2)),
    ("bwd ms", "backward_ms", fmt(2)), ("bwd TFLOPS", "backward_tflops", fmt(1)),
    ("bwd / cuBLAS fwd", "backward_vs_cublas", fmt(2)), ("fwd+bwd ms", "fwd_bwd_ms", fmt(2)),
    ("peak extra MiB", "peak_extra_mib", fmt(0)), ("extra / fp32 logits", "extra_over_fp32_logits", fmt(4)),
    ("status", "status", text), ("note", "note", text)]

OFFLOAD_COLUMNS: list[Column] = [
    ("layers", "layers", text), ("params GiB", "params_gib", fmt(3)), ("grads GiB", "grads_gib", fmt(3)),
    ("optimizer GiB", "optimizer_gib", fmt(3)), ("allocated GiB", "allocated_gib", fmt(3)),
    ("offloaded: allocated GiB", "allocated_offloaded_gib", fmt(3)),
    ("reloaded: allocated GiB", "allocated_reloaded_gib", fmt(3)), ("offload s", "offload_s", fmt(3)),
    ("reload s", "reload_s", fmt(3)), ("offload GB/s", "offload_gb_s", fmt(1)), ("reload GB/s", "reload_gb_s", fmt(1)),
    ("bit-identical", "identical", _ok), ("next step identical", "next_step_identical", _ok),
    ("status", "status", text)]

ATTENTION_COLUMNS: list[Column] = [
    ("layout", "layout", text), ("window", "window", text), ("dtype", "dtype", text), ("path", "path", text),
    ("tokens", "tokens", text), ("fused err", "fused_err", fmt(8)), ("local err", "local_err", fmt(8)),
    ("tolerance", "tolerance", text), ("fused ms", "fused_ms", fmt(2)), ("local ms", "local_ms", fmt(2)),
    ("fused extra GiB", "fused_extra_gib", fmt(3)), ("local extra GiB", "local_extra_gib", fmt(3)),
    ("status", "status", text), ("note", "note", text)]
ACTOR_MODES = ("padded", "token_budget", "packed", "fused_lm_head", "token_budget_local")  # actor_bench.MODES

PARTS = [
    Part("kernel_correctness", "benchmarks.gpu.check_kernels", 90.0, KERNEL_COLUMNS),
    Part("attention_correctness", "benchmarks.gpu.check_attention", 45.0, ATTENTION_COLUMNS),
    # one part per actor mode, each with its own budget (a slow mode cannot starve the next)
    *(Part(f"actor_{mode}", "benchmarks.gpu.actor_bench", 80.0, ACTOR_COLUMNS, extra_args=("--modes", mode))
      for mode in ACTOR_MODES),
    Part("actor_offload", "benchmarks.gpu.offload_check", 90.0, OFFLOAD_COLUMNS),
    Part("kernel_grid", "benchmarks.gpu.kernel_grid", None, GRID_COLUMNS,
         tiny_args=("--tiny", "--warmup", "0", "--iters", "1")),
]


def run_part(part: Part, out_dir: Path, device: str, budget_s: float, tiny: bool, extra: list[str]) -> dict:
    """Run one part in its own process group under `budget_s`; return its status and records."""
    jsonl, log = out_dir / f"{part.name}.jsonl", out_dir / f"{part.name}.log"
    jsonl.unlink(missing_ok=True)
    start = time.time()
    command = [sys.executable, "-m", part.module, "--out", str(jsonl), "--device", device,
               "--deadline", f"{start + max(budget_s - GRACE_S, 1.0):.0f}", *(part.tiny_args if tiny else ()),
               *part.extra_args, *extra]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if device == "cpu":
        env["TRITON_INTERPRET"] = "1"  # before triton is imported: the Triton backend runs interpreted on CPU
    timed_out = False
    with open(log, "w") as log_file:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log_file, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=budget_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc, timed_out = proc.wait(), True
    records = read_records(jsonl)
    statuses = {r.get("status") for r in records}
    if timed_out or rc != 0 and not records:
        tail = log.read_text().strip().splitlines()[-1:] if log.exists() else []
        status, note = "failed", ("killed at its time budget" if timed_out else f"exit {rc}: {' '.join(tail)}"[:300])
    elif "failed" in statuses or rc != 0:
        status, note = "failed", f"{sum(r.get('status') == 'failed' for r in records)} measurement(s) failed"
    elif "skipped" in statuses:
        status, note = "ok", f"{sum(r.get('status') == 'skipped' for r in records)} skipped (see notes)"
    else:
        status, note = "ok", None
    return {"status": status, "note": note, "rc": rc, "seconds": time.time() - start, "budget_s": budget_s,
            "log": log.name, "records": records}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    parser.add_argument("--out", default=str(ROOT / "runs" / "gpu_check" / stamp), help="results folder")
    parser.add_argument("--budget-s", type=float, default=500.0, help="seconds for all parts together")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (CPU smoke test), not a measurement")
    parser.add_argument("--parts", default=",".join(p.name for p in PARTS))
    parser.add_argument("--layers", type=int, default=None, help="actor layers (default: 28, Qwen2.5-1.5B)")
    args = parser.parse_args(argv)
    names = args.parts.split(",")
    unknown = [n for n in names if n not in {p.name for p in PARTS}]
    if unknown:
        parser.error(f"unknown parts {unknown}; choose from {[p.name for p in PARTS]}")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    end = time.time() + args.budget_s
    model_cache = Path(tempfile.mkdtemp(prefix="gpu_check_model_"))
    summary = {"environment": environment(), "command": " ".join(["python -m benchmarks.gpu.run_check", *sys.argv[1:]]),
               "budget_s": args.budget_s, "tiny": args.tiny, "parts": {}}
    tables = {}
    for part in (p for p in PARTS if p.name in names):
        remaining = end - time.time()
        budget = min(part.budget_s or remaining, remaining)
        if budget < 5:
            summary["parts"][part.name] = {"status": "skipped", "note": "no time left", "records": []}
            continue
        extra = []
        if part.module == "benchmarks.gpu.actor_bench":  # the actor parts share one random model
            extra = ["--model-cache", str(model_cache)] + (["--layers", str(args.layers)] if args.layers else [])
        result = run_part(part, out_dir, args.device, budget, args.tiny, extra)
        if part.name == "kernel_grid":
            from benchmarks.gpu.kernel_grid import add_ratios
            add_ratios(result["records"])
        summary["parts"][part.name] = result
        tables[part.name] = markdown_table(result["records"], part.columns)
        print(f"gpu_check: {part.name}: {result['status']} in {result['seconds']:.0f} s of {budget:.0f} s"
              + (f" ({result['note']})" if result["note"] else ""), flush=True)
    shutil.rmtree(model_cache, ignore_errors=True)
    json_path, md_path = write_results(out_dir, summary, tables)
    print(f"gpu_check: results in {json_path} and {md_path}")
    return 1 if any(p["status"] == "failed" for p in summary["parts"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
