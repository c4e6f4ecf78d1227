"""What a vLLM CPU engine takes of the machine it shares with the trainer: its KV cache and its cores.

KV cache (`VLLM_CPU_KVCACHE_SPACE`, whole GiB, allocated when the engine starts): with `rollout.kv_cache_gib: auto`
it is what the engine can use, `max_num_seqs` sequences of `max_model_len` tokens (in vLLM's 128-token CPU blocks,
at the model's K/V width and the engine's dtype), but at most `KV_SHARE_OF_AVAILABLE` of the memory available when
the engines start, split over the engines of the machine, since the trainer builds its actor after them; at least 1.

Cores (`VLLM_CPU_OMP_THREADS_BIND`): vLLM's own default pins one worker thread to each core of the first NUMA node
but one, which it reserves for its scheduler, and it does so for every engine alike. On a machine of a few cores,
where the trainer waits while the engines generate (synchronous training), that leaves cores idle (on 2 cores, half
the machine) and puts every engine's worker on the same core. `engine_thread_environment` gives each engine its
share of the cores the process may use instead (all of them for one engine). When the engines generate while the
trainer trains (asynchronous training) the two would fight for every core: the engines take the last half of the
cores and the trainer's torch threads the rest (`trainer_threads`). Measured in benchmarks/rollout/README.md
("Threads of a CPU engine"). A variable already set (in the environment or `engine_env`) is kept.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import psutil

GIB = 1 << 30
KV_SHARE_OF_AVAILABLE = 0.25
VLLM_CPU_BLOCK_TOKENS = 128
DEFAULT_MAX_NUM_SEQS = 128  # vLLM's default for an AsyncLLM on CPU
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_bytes_per_token(model_path: str, dtype: str) -> int | None:
    """K and V of every layer for one token, from the model's config.json; None when it cannot be read."""
    try:
        hf = json.loads((Path(model_path) / "config.json").read_text())
        hf = hf.get("text_config", hf)
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        kv_heads = hf.get("num_key_value_heads") or hf["num_attention_heads"]
        return 2 * hf["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def auto_kv_cache_gib(model_path: str, dtype: str, max_model_len: int, max_num_seqs: int | None, engines: int,
                      available_bytes: int) -> int:
    """Whole GiB of KV cache for one of `engines` CPU engines on a machine with `available_bytes` free: what its
    sequences can fill, capped by the engines' share of the free memory, at least 1 (the module docstring)."""
    per_token = kv_bytes_per_token(model_path, dtype)
    if per_token is None:
        return 1
    blocks = math.ceil(max_model_len / VLLM_CPU_BLOCK_TOKENS)
    tokens = (max_num_seqs or DEFAULT_MAX_NUM_SEQS) * blocks * VLLM_CPU_BLOCK_TOKENS
    wanted = math.ceil(per_token * tokens / GIB)
    share = int(available_bytes * KV_SHARE_OF_AVAILABLE / max(1, engines) // GIB)
    return max(1, min(wanted, share))


def available_memory_bytes() -> int:
    return psutil.virtual_memory().available


def engines_core_count(cores: int, overlaps_training: bool) -> int:
    """How many of the machine's `cores` the engines take: all of them while the trainer waits for them, half (at
    least 1) when they generate while it trains (asynchronous training), the trainer keeping the rest."""
    return max(1, cores // 2) if overlaps_training and cores > 1 else cores


def trainer_threads(cores: int) -> int:
    """The trainer's torch threads when the engines generate beside it: the cores the engines leave."""
    return max(1, cores - engines_core_count(cores, overlaps_training=True))


def engine_cores(cores: list[int], engines: int, engine_index: int, overlaps_training: bool = False) -> list[int]:
    """The cores of engine `engine_index` of `engines` on a machine whose usable cores are `cores`: an equal share of
    the engines' cores (the last ones; all of them for one engine that does not overlap training; more engines than
    cores share them in turn)."""
    pool = cores[len(cores) - engines_core_count(len(cores), overlaps_training):]
    share = max(1, len(pool) // max(1, engines))
    start = (engine_index % max(1, len(pool) // share)) * share
    return pool[start:start + share]


def engine_thread_environment(cores: list[int], engines: int, engine_index: int,
                              overlaps_training: bool = False) -> dict[str, str]:
    """vLLM's worker binding for that engine: one OpenMP thread pinned to each of its cores. An explicit list
    reserves no core for vLLM's scheduler, which waits while the worker computes."""
    mine = engine_cores(cores, engines, engine_index, overlaps_training)
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, mine))}


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity: a container's or SLURM's cpuset)."""
    return sorted(os.sched_getaffinity(0))
