"""The vLLM CPU engine's threads on a small machine: generation tokens/s, alone and beside a busy trainer, and the CPU
an idle engine burns, for each way of giving the engine its cores.

Each setting starts one engine (a private Ray cluster) with the environment it names, generates a warm-up and then
`--prompts` x `--n` samples of `--max-tokens` tokens (timed: "alone"), generates them again while this process
multiplies float32 matrices on `--trainer-threads` torch threads (a trainer updating beside it, as in asynchronous
training; both rates are recorded), and finally sits idle for `--idle-s` seconds, counting the CPU seconds its
processes (the Ray actor, vLLM's engine core and worker) use meanwhile. Settings:
- `vllm`: vLLM's own default (`VLLM_CPU_OMP_THREADS_BIND=auto`), which the engines keep: one worker thread per
  physical core of the first NUMA node, less one core reserved for its scheduler (on 2 cores: 1 thread on core 0);
- `all`: the worker's threads on every core (`VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`, nothing reserved);
- `nobind`: no pinning, `OMP_NUM_THREADS` = the cores.
Also `--dtypes`: the same for each engine dtype (engine tokens/s per dtype).

    python benchmarks/rollout/bench_cpu_threads.py --model examples/smollm2-135m/model --settings vllm all
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
from pathlib import Path

import psutil
import torch

ROOT = Path(__file__).resolve().parents[2]


def setting_environment(name: str, cores: int) -> dict[str, str]:
    """The engine's environment for a setting of the module docstring."""
    return {"vllm": {"VLLM_CPU_OMP_THREADS_BIND": "auto"},
            "all": {"VLLM_CPU_OMP_THREADS_BIND": f"0-{cores - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
            "nobind": {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(cores)}}[name]


def _engine_tree(manager) -> list[psutil.Process]:
    """The engine actors and everything they started (vLLM's engine core, its worker)."""
    processes = []
    for pid_file in Path(manager._pid_dir).glob("*.pid"):
        actor = psutil.Process(int(pid_file.read_text().split()[1]))
        processes += [actor, *actor.children(recursive=True)]
    return processes


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            pass
    return total


def _generate(manager, args, tag: str) -> tuple[int, float]:
    from megatron_cpo.rollout import SamplingParams

    params = SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
    start = time.perf_counter()
    for i in range(args.prompts):
        manager.submit(f"{tag}{i}", [1] + [400 + (i * 7 + j) % 3000 for j in range(args.prompt_len)], params)
    tokens = sum(len(s.token_ids) for g in manager.completed(timeout=3600) for s in g.samples)
    return tokens, time.perf_counter() - start


def _trainer_load(threads: int, stop: threading.Event, rate: list[float]) -> None:
    """A trainer's update stand-in: float32 matmuls on `threads` torch threads until `stop`; GFLOP/s into `rate`."""
    torch.set_num_threads(threads)
    a, b = torch.randn(2048, 576), torch.randn(576, 1536)
    start, calls = time.perf_counter(), 0
    while not stop.is_set():
        a @ b
        calls += 1
    rate.append(2 * 2048 * 576 * 1536 * calls / (time.perf_counter() - start) / 1e9)


def bench(setting: str, dtype: str, args) -> dict:
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, RolloutManager, SamplingParams

    cores = len(os.sched_getaffinity(0))
    environment = setting_environment(setting, cores)
    config = EngineLaunchConfig(model_path=args.model, dtype=dtype, max_model_len=args.prompt_len + args.max_tokens + 8,
                                engines=RolloutEngineConfig(kv_cache_gib=args.kv_cache_gib, ray_address="local"),
                                engine_env=environment, engine_start_timeout_s=1800)
    row = {"setting": setting, "dtype": dtype, "environment": environment, "cores": cores,
           "load_1min_before": os.getloadavg()[0]}
    with RolloutManager(config) as manager:
        manager.submit("warmup", [1, 400, 401], SamplingParams(max_tokens=8))
        list(manager.completed(timeout=600))
        tokens, seconds = _generate(manager, args, "alone")
        row.update(tokens=tokens, alone_s=round(seconds, 2), alone_tokens_per_s=round(tokens / seconds, 1))
        stop, rate = threading.Event(), []
        trainer = threading.Thread(target=_trainer_load, args=(args.trainer_threads, stop, rate))
        trainer.start()
        tokens, seconds = _generate(manager, args, "beside")
        stop.set()
        trainer.join()
        row.update(beside_trainer_tokens_per_s=round(tokens / seconds, 1), trainer_gflops_beside=round(rate[0], 1))
        processes = _engine_tree(manager)
        time.sleep(2.0)  # vLLM's readers poll for 1 s after their last message before they wait idle
        before = _cpu_seconds(processes)
        time.sleep(args.idle_s)
        row["idle_cpu_s_per_s"] = round((_cpu_seconds(processes) - before) / args.idle_s, 3)
    row["load_1min_after"] = os.getloadavg()[0]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "examples/smollm2-135m/model"))
    parser.add_argument("--settings", nargs="+", default=["vllm", "all"], choices=["vllm", "all", "nobind"])
    parser.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=1, help="alternate the settings this many times")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=48)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--trainer-threads", type=int, default=2)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="append one JSON line per engine here")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for dtype in args.dtypes:
            for setting in args.settings:
                row = bench(setting, dtype, args)
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
