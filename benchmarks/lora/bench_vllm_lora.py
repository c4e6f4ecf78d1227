"""Can vLLM's CPU build serve LoRA adapters, and what would pushing only the adapter save per weight push?

    python benchmarks/lora/bench_vllm_lora.py                    # SmolLM2-135M (examples/smollm2-135m/model)
    python benchmarks/lora/bench_vllm_lora.py --model examples/tiny/model --ranks 4 --out /tmp/tiny.json

Writes PEFT adapters of each rank on every linear layer (B random, small: a trained adapter's size) and the same
adapters merged into the base (PEFT's `merge_and_unload`). Then, one engine at a time, each in its own process:
1. the base model's engine without LoRA: start-up, generation time of a step's batch (8 prompts x 8 samples, 64
   tokens each at temperature 0.7, after a warm-up request) and a greedy probe with its log-probs;
2. per rank, the base model's engine with `enable_lora` and the adapter: start-up, loading the adapter
   (`add_lora`), reloading a changed adapter in place (`load_inplace`, what a push would do each step), the same
   generation under the adapter and the greedy probe, whose tokens and log-probs must equal
3. the merged model's engine's (no LoRA; for the first rank).
Results (seconds, bytes, the largest log-prob difference of the probe) go to a JSON file; docs/lora.md quotes them.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 5, 9, 17, 33, 64, 7, 80, 90, 101], [3, 4, 100, 2, 8, 44, 45, 46], [12, 13, 14, 15, 16, 17, 18, 19]]


def write_adapters(model: Path, ranks: list[int], work: Path) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    made = {}
    for rank in ranks:
        torch.manual_seed(rank)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32),
                                    LoraConfig(r=rank, lora_alpha=32, target_modules="all-linear",
                                               init_lora_weights=False))
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.mul_(0.02)
        peft_model.save_pretrained(work / f"adapter_r{rank}")
        merged = peft_model.merge_and_unload()
        merged.save_pretrained(work / f"merged_r{rank}")
        AutoTokenizer.from_pretrained(model).save_pretrained(work / f"merged_r{rank}")
        made[rank] = {"adapter_bytes": (work / f"adapter_r{rank}" / "adapter_model.safetensors").stat().st_size,
                      "model_bytes": sum(p.numel() * p.element_size() for p in merged.parameters())}
    return made


def serve(model: str, adapter: str | None, rank: int) -> dict:
    """One engine (in this process): its timings and the probe's greedy tokens and log-probs."""
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    options = dict(model=model, dtype="float32", max_model_len=512, seed=0)
    if adapter:
        options.update(enable_lora=True, max_lora_rank=max(8, rank), max_loras=1)
    started = time.perf_counter()
    llm = LLM(**options)
    result = {"start_s": time.perf_counter() - started}
    request = None
    if adapter:
        request = LoRARequest("policy", 1, adapter)
        started = time.perf_counter()
        llm.llm_engine.add_lora(request)
        result["add_lora_s"] = time.perf_counter() - started
        reloads = []
        for _ in range(3):
            started = time.perf_counter()
            llm.llm_engine.add_lora(LoRARequest("policy", 1, adapter, load_inplace=True))
            reloads.append(time.perf_counter() - started)
        result["reload_inplace_s"] = reloads
    prompts = [{"prompt_token_ids": ids} for ids in PROMPTS]
    batch = [{"prompt_token_ids": PROMPTS[i % len(PROMPTS)]} for i in range(8)]
    llm.generate(batch[:1], SamplingParams(max_tokens=4), lora_request=request)  # warm-up
    timings = []
    for _ in range(1):
        started = time.perf_counter()
        llm.generate(batch, SamplingParams(n=8, temperature=0.7, max_tokens=64, seed=0, ignore_eos=True),
                     lora_request=request)
        timings.append(time.perf_counter() - started)
    result["generate_s"] = timings
    probe = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, logprobs=0), lora_request=request)
    result["probe"] = [{"ids": list(out.outputs[0].token_ids),
                        "logprobs": [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]}
                       for out in probe]
    return result


def run_engine(args: argparse.Namespace, model: str, adapter: str | None, rank: int) -> dict:
    command = [sys.executable, __file__, "--serve", model, "--rank", str(rank)] + (["--adapter", adapter]
                                                                                     if adapter else [])
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"engine for {model} (adapter {adapter}) failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def probe_gap(a: dict, b: dict) -> float:
    gap = 0.0
    for x, y in zip(a["probe"], b["probe"]):
        if x["ids"] != y["ids"]:
            return float("inf")
        gap = max(gap, max(abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"])))
    return gap


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "examples" / "smollm2-135m" / "model")
    parser.add_argument("--ranks", type=int, nargs="+", default=[32, 1])
    parser.add_argument("--work", type=Path, default=REPO / "outputs" / "bench_vllm_lora")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("vllm_lora_results.json"))
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--adapter", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        print("RESULT " + json.dumps(serve(args.serve, args.adapter, args.rank)), flush=True)
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = write_adapters(args.model, args.ranks, args.work)
    results = {"model": str(args.model), "cpu": open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0]
               .strip(" :\t"), "ranks": {}}

    def record(name: str, value) -> None:  # written as it comes: a run cut short keeps what it measured
        results[name] = value
        results["loadavg"] = os.getloadavg()
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        print(f"{name}: {json.dumps(value)[:400]}", flush=True)

    record("base", run_engine(args, str(args.model), None, 0))
    for rank in args.ranks:
        lora = run_engine(args, str(args.model), str(args.work / f"adapter_r{rank}"), rank)
        record(f"lora_r{rank}", lora)
        results["ranks"][rank] = {**sizes[rank], "lora": lora}
        if rank == args.ranks[0]:  # the merged model's engine, once: the probe must give the same tokens
            merged = run_engine(args, str(args.work / f"merged_r{rank}"), None, 0)
            results["ranks"][rank].update(merged=merged, probe_max_abs_diff=probe_gap(lora, merged))
        record("ranks", results["ranks"])
    for rank, found in results["ranks"].items():
        print(f"rank {rank}: adapter {found['adapter_bytes'] / 1e6:.1f} MB vs model {found['model_bytes'] / 1e6:.1f} "
              f"MB; add_lora {found['lora']['add_lora_s']:.2f} s, in-place reload "
              f"{min(found['lora']['reload_inplace_s']):.2f} s; generation {min(found['lora']['generate_s']):.1f} s "
              f"with LoRA vs {min(results['base']['generate_s']):.1f} s without; probe gap to the merged model "
              f"{found.get('probe_max_abs_diff', float('nan')):.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
