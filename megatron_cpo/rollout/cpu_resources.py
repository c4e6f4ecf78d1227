"""What a vLLM CPU engine takes of the machine it shares with the trainer: its KV cache (`rollout.kv_cache_gib: auto`
sizes it from the engine's needs, capped by a share of the free memory) and its cores (vLLM's own binding, one core
left to the scheduler). Sizes and the measurement behind them: docs/rollout.md.
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
