"""What a vLLM CPU engine takes of the machine it shares with the trainer: its KV cache.

KV cache (`VLLM_CPU_KVCACHE_SPACE`, whole GiB, allocated when the engine starts): with `rollout.kv_cache_gib: auto`
it is what the engine can use, `max_num_seqs` sequences of `max_model_len` tokens (in vLLM's 128-token CPU blocks,
at the model's K/V width and the engine's dtype), but at most `KV_SHARE_OF_AVAILABLE` of the memory available when
the engines start, split over the engines of the machine, since the trainer builds its actor after them; at least 1.

Cores are left to vLLM's own binding (`VLLM_CPU_OMP_THREADS_BIND=auto`): one worker thread per core of the first
NUMA node but one, which stays free for vLLM's scheduler, which polls while the worker computes. Giving the worker
that core too made generation several times slower (benchmarks/rollout/README.md, "Threads of a CPU engine").
"""
from __future__ import annotations

import json
import math
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
