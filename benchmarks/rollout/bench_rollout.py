"""Rollout benchmark on CPU: generation throughput (tokens/s) and weight-sync time against model size.

For each model size a tiny-family Qwen2 model is written, one vLLM engine is started on a private Ray cluster,
a batch of prompts is generated (n samples each; `--prompts 0` skips generation), and the full HF state dict of a
perturbed copy is synced into the engine several times through each weight transport of `--transports` (shared-memory
buckets, and/or broadcasts over the gloo weight-sync group). Prints a markdown table row per size.

    python benchmarks/rollout/bench_rollout.py --sizes 128x2 512x4 1024x8
    python benchmarks/rollout/bench_rollout.py --sizes 128x2 512x4 1024x8 --prompts 0 --transports shm collective
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def _bench_size(hidden: int, layers: int, args, workdir: str) -> dict:
    from transformers import AutoModelForCausalLM

    from megatron_cpo.models.tiny import write_tiny_model
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager, SamplingParams

    model_dir = write_tiny_model(os.path.join(workdir, f"qwen2-{hidden}x{layers}"), family="qwen2", seed=0,
                                 hidden_size=hidden, intermediate_size=hidden * 2, num_hidden_layers=layers,
                                 num_attention_heads=hidden // 32, num_key_value_heads=max(1, hidden // 64))
    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    num_params = sum(p.numel() for p in hf_model.parameters())
    config = EngineLaunchConfig(model_path=str(model_dir), dtype="float32", max_model_len=1024,
                                engines=RolloutEngineConfig(kv_cache_gib=1, ray_address="local"),
                                engine_start_timeout_s=1800,
                           weight_sync_bucket_mb=args.bucket_mb)
    start = time.perf_counter()
    with RolloutManager(config) as manager:
        start_s = time.perf_counter() - start
        params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
        for warm in range(2):
            manager.submit(f"warmup-{warm}", [1, 40, 41], SamplingParams(max_tokens=8))
        list(manager.completed(timeout=600))
        tokens, gen_s = 0, 0.0
        if args.prompts:
            begin = time.perf_counter()
            for i in range(args.prompts):
                manager.submit(f"p{i}", [1] + [40 + (i + j) % 60 for j in range(args.prompt_len)], params)
            tokens = sum(len(s.token_ids) for g in manager.completed(timeout=1800) for s in g.samples)
            gen_s = time.perf_counter() - begin

        with torch.no_grad():
            for p in hf_model.parameters():
                p.mul_(1.01)
        state = hf_model.state_dict()
        # The first collective sync also opens the weight-sync group: it is timed as `group_init_s` and kept apart.
        # Transports alternate within each repeat so that a change in the machine's load affects them alike.
        syncs = {transport: [] for transport in args.transports}
        if "collective" in syncs:
            syncs["collective"].append(manager.sync_weights(state.items(), transport="collective"))
        for _ in range(args.sync_repeats):
            for transport in args.transports:
                syncs[transport].append(manager.sync_weights(state.items(), transport=transport))
    row = {"hidden": hidden, "layers": layers, "params_m": num_params / 1e6, "engine_start_s": start_s,
           "generated_tokens": tokens, "generate_s": gen_s, "tokens_per_s": tokens / gen_s if gen_s else 0.0}
    for transport, sync in syncs.items():
        if transport == "collective":
            row["collective_group_init_s"] = sync[0]["group_init_seconds"]
            sync = sync[1:]
        row.update({"sync_mb": sync[0]["bytes"] / 2**20, "sync_buckets": sync[0]["buckets"],
                    f"{transport}_sync_s_median": sorted(m["seconds"] for m in sync)[len(sync) // 2]})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["128x2", "512x4", "1024x8"], help="HIDDENxLAYERS")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--bucket-mb", type=float, default=64.0)
    parser.add_argument("--sync-repeats", type=int, default=3)
    parser.add_argument("--transports", nargs="+", default=["shm"], choices=["shm", "collective"])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    torch.set_num_threads(min(2, torch.get_num_threads()))
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for size in args.sizes:
            hidden, layers = (int(v) for v in size.split("x"))
            rows.append(_bench_size(hidden, layers, args, workdir))
            print(json.dumps(rows[-1]), flush=True)
    sync_columns = [f"{t}_sync_s_median" for t in args.transports]
    print("| hidden x layers | params (M) | engine start (s) | gen tokens | tokens/s | sync MB | buckets | "
          + " | ".join(f"{t} sync s" for t in args.transports) + " |")
    print("|---" * (7 + len(sync_columns)) + "|")
    for r in rows:
        print(f"| {r['hidden']} x {r['layers']} | {r['params_m']:.2f} | {r['engine_start_s']:.0f} | "
              f"{r['generated_tokens']} | {r['tokens_per_s']:.0f} | {r['sync_mb']:.1f} | {r['sync_buckets']:.0f} | "
              + " | ".join(f"{r[c]:.3f}" for c in sync_columns) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
