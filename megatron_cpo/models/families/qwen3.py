"""Qwen3 dense (`model_type` qwen3): per-head q/k RMSNorm, an explicit head_dim, optional attention bias."""
from __future__ import annotations

from megatron_cpo.models.families.base import Family
from megatron_cpo.models.hf_options import HONOURED, SLIDING_WINDOW_HOW, Option

QK_NORM = Option("q_norm, k_norm (Qwen3)", HONOURED,
                 "per-head RMSNorm of queries and keys before RoPE: qk_layernorm (q_layernorm / k_layernorm, "
                 "epsilon rms_norm_eps)")
ATTENTION_BIAS = Option("attention_bias (Qwen3)", HONOURED, "q/k/v bias (add_qkv_bias) and o_proj bias, as Llama's")


class Qwen3(Family):
    model_type = "qwen3"
    label = "Qwen3"
    qk_norm = True
    options = (QK_NORM, ATTENTION_BIAS,
               Option("use_sliding_window, sliding_window, max_window_layers, layer_types (Qwen3)", HONOURED,
                      SLIDING_WINDOW_HOW))
