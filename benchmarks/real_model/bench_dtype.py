"""bfloat16 against float32 on this CPU, as each CPU kind runs them: matmul GFLOP/s and a SmolLM2-sized forward.

Why: torch computes bf16 on every CPU, but only CPUs with bf16 instructions (x86 `avx512_bf16` / `amx_bf16`, Arm
`bf16`) multiply it natively; elsewhere oneDNN emulates it (AVX-512) or torch's reference kernel runs it (AVX2), and
bf16 is slower than float32. `params_dtype: auto` (megatron_cpo/compute_dtype.py) chooses by that; this measures it.

Each `--isa` runs in a fresh interpreter, since oneDNN reads its ISA cap once: `native` (the CPU as it is) and
`avx2` (`ONEDNN_MAX_CPU_ISA=AVX2` and `ATEN_CPU_CAPABILITY=avx2`: an AVX-512 machine computing as an AVX2-only CPU
does). It records torch's and oneDNN's answers next to the rates, and the 1-minute load average before and after
(on a shared machine read the ratios, not the absolute rates).

    python benchmarks/real_model/bench_dtype.py [--isa native avx2] [--threads 2] [--out results.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ISA_ENVIRONMENTS = {"native": {}, "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
MATMUL_SHAPES = ((2048, 576, 1536), (512, 576, 49152))  # SmolLM2's MLP up-projection; its lm-head on 512 tokens
# SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads, 3 KV heads, SwiGLU 1536, vocab 49152), random weights
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True, max_position_embeddings=2048)


def _rate(run, flops: float, seconds: float) -> float:
    """GFLOP/s of `run` repeated for about `seconds` after one warm-up call."""
    run()
    start, calls = time.perf_counter(), 0
    while time.perf_counter() - start < seconds or calls < 2:
        run()
        calls += 1
    return flops * calls / (time.perf_counter() - start) / 1e9


def measure(threads: int, seconds: float, forward_tokens: tuple[int, int]) -> dict:
    """This interpreter's rates (its ISA is the environment it was started with)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from megatron_cpo.compute_dtype import bf16_support

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    result = {"torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "mkldnn_bf16_supported": bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()),
              "cpu_avx512_bf16": bool(torch.cpu.get_capabilities().get("avx512_bf16", False)),
              "cpu_amx_bf16": bool(torch.cpu.get_capabilities().get("amx_bf16", False)),
              "auto_native_bf16": bf16_support().native, "auto_reason": bf16_support().why, "matmul_gflops": {}}
    for m, k, n in MATMUL_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            key = f"[{m}x{k}]@[{k}x{n}] {str(dtype).removeprefix('torch.')}"
            result["matmul_gflops"][key] = round(_rate(lambda a=a, b=b: a @ b, 2 * m * k * n, seconds), 2)
    rows, length = forward_tokens
    config = LlamaConfig(**SMOLLM2_SHAPE)
    model = LlamaForCausalLM(config).eval()
    tokens = torch.randint(0, config.vocab_size, (rows, length))
    result["forward_s"] = {}
    for dtype in (torch.float32, torch.bfloat16):
        model.to(dtype)
        with torch.no_grad():
            model(tokens[:1, :8])  # warm-up
            start = time.perf_counter()
            model(tokens)
            result["forward_s"][f"{rows}x{length} tokens {str(dtype).removeprefix('torch.')}"] = round(
                time.perf_counter() - start, 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", nargs="+", default=list(ISA_ENVIRONMENTS), choices=list(ISA_ENVIRONMENTS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=3.0, help="time per matmul rate")
    parser.add_argument("--forward", default="8x128", help="rows x tokens of the SmolLM2-sized forward")
    parser.add_argument("--out", default=None, help="write the results JSON here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    rows, length = (int(x) for x in args.forward.split("x"))
    if args.child:
        print(json.dumps(measure(args.threads, args.seconds, (rows, length))), flush=True)
        return
    results = {"cpu": _cpu_name(), "threads": args.threads, "runs": {}}
    for isa in args.isa:
        environment = {**os.environ, "PYTHONPATH": str(ROOT), **ISA_ENVIRONMENTS[isa]}
        load_before = os.getloadavg()[0]
        done = subprocess.run([sys.executable, __file__, "--child", "--threads", str(args.threads), "--seconds",
                               str(args.seconds), "--forward", args.forward], env=environment, check=True,
                              capture_output=True, text=True)
        run = json.loads(done.stdout.strip().splitlines()[-1])
        run["environment"] = ISA_ENVIRONMENTS[isa]
        run["load_1min_before_after"] = [load_before, os.getloadavg()[0]]
        results["runs"][isa] = run
        print(isa, json.dumps(run), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2) + "\n")


def _cpu_name() -> str:
    """lscpu's model name and whether the CPU reports bf16 instructions."""
    import torch

    capabilities = torch.cpu.get_capabilities()
    flags = [name for name in ("avx2", "avx512_f", "avx512_bw", "avx512_bf16", "amx_bf16", "bf16")
             if capabilities.get(name)]
    return f"{capabilities.get('cpu_name', 'unknown')} ({', '.join(flags)})"


if __name__ == "__main__":
    main()
