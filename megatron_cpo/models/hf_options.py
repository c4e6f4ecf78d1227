"""Which HF config options the Megatron model honours, which change nothing, and which are refused.

Every option that changes the forward pass is mapped onto Megatron-Core (tested against transformers' logits) or
refused in one line: nothing is dropped silently. `OPTIONS` audits the options all families share (each family adds
its rows; docs/conversion.md renders them), `check_supported_options` refuses (transformers 5.19, Megatron-Core 0.16.1).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

HONOURED, NO_EFFECT, REFUSED = "honoured", "no effect on the forward", "refused"


@dataclass(frozen=True)
class Option:
    """One HF config option: what we do with it and how."""

    name: str
    verdict: str
    how: str


SLIDING_WINDOW_HOW = ("the layers transformers slides get Megatron's window_size=(sliding_window - 1, 0) through a "
                      "per-layer window_attn_skip_freq list; the window is applied when the model is called without an "
                      "attention mask, as this project's forward passes do")
OPTIONS = (
    Option("vocab_size, hidden_size, intermediate_size, num_hidden_layers", HONOURED, "Megatron sizes"),
    Option("num_attention_heads, num_key_value_heads, head_dim", HONOURED,
           "grouped-query attention; kv_channels = head_dim (else hidden_size / heads)"),
    Option("rms_norm_eps", HONOURED, "RMSNorm epsilon"),
    Option("hidden_act", f"{HONOURED} / {REFUSED}", "'silu' (SwiGLU); any other activation is refused"),
    Option("tie_word_embeddings", HONOURED, "shared embedding/output weight (a PP>1 last stage keeps a copy); an "
                                            "lm_head.weight in the files must then equal the embedding"),
    Option("rope_theta", HONOURED, "rotary_base"),
    Option("rope_type 'default'", HONOURED, "plain RoPE"),
    Option("rope_type 'linear'", HONOURED, "positions divided by factor (seq_len_interpolation_factor)"),
    Option("rope_type 'llama3'", f"{HONOURED} / {REFUSED}",
           "Megatron-Core hard-codes low_freq_factor=1, high_freq_factor=4, original_max_position_embeddings=8192; "
           "other values are refused"),
    Option("rope_type 'dynamic', 'yarn', 'longrope' and others", REFUSED, "no equivalent GPTModel RoPE"),
    Option("partial_rotary_factor", f"{HONOURED} / {REFUSED}", "1.0 only"),
    Option("attention_dropout", HONOURED, "Megatron attention dropout (train mode only, as in transformers)"),
    Option("max_position_embeddings", NO_EFFECT, "RoPE is computed for any length, as in transformers"),
    Option("initializer_range", NO_EFFECT, "initialisation only (weights are loaded)"),
    Option("use_cache, bos/eos/pad_token_id, dtype (torch_dtype)", NO_EFFECT,
           "generation settings; dtype is the default dtype the converters write"),
)

_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# Megatron-Core's Llama-3 RoPE scaling hard-codes these; configs that differ would silently get other frequencies.
MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_parameters(hf_config: Any) -> dict:
    """The config's RoPE parameters as one dict (transformers 5's `rope_parameters`, or the legacy fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    if not params:
        params = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0),
                  **(getattr(hf_config, "rope_scaling", None) or {})}
    return params


def rope_settings(hf_config: Any) -> dict:
    """GPTModel keyword arguments for the config's RoPE (theta, Llama-3 scaling or linear interpolation)."""
    params = rope_parameters(hf_config)
    rope_type = params.get("rope_type", params.get("type", "default"))
    settings = {"rotary_base": params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)),
                "rope_scaling": False}
    partial = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor={partial} is not supported (these families rotate every "
                         f"dimension); only 1.0 is")
    if rope_type == "default":
        return settings
    if rope_type == "linear":
        return {**settings, "seq_len_interpolation_factor": float(params["factor"])}
    if rope_type == "llama3":
        mismatched = {k: params.get(k) for k, v in MEGATRON_LLAMA3_ROPE.items() if float(params.get(k, v)) != v}
        if mismatched:
            raise ValueError(f"llama3 RoPE scaling with {mismatched} is not supported; Megatron-Core implements "
                             f"only {MEGATRON_LLAMA3_ROPE}")
        return {**settings, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"unsupported RoPE scaling rope_type={rope_type!r}; supported: {list(_SUPPORTED_ROPE_TYPES)}")


def sliding_window_layers(hf_config: Any) -> list[int]:
    """Indices of the layers transformers runs with a sliding window of `sliding_window` tokens (empty: none).

    When `use_sliding_window` is not false: the layers `layer_types` marks "sliding_attention" (Qwen2, Qwen3,
    Qwen2-MoE: by default those at or past `max_window_layers`); without `layer_types`, the layers from
    `max_window_layers` (absent: every layer, as Qwen3-MoE and Mixtral slide). Llama has no sliding window.
    """
    window = getattr(hf_config, "sliding_window", None)
    if window is None or getattr(hf_config, "use_sliding_window", True) is False:
        return []
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is None:
        return list(range(getattr(hf_config, "max_window_layers", 0), hf_config.num_hidden_layers))
    return [i for i, kind in enumerate(layer_types) if kind == "sliding_attention"]


def sliding_window_settings(hf_config: Any) -> dict:
    """TransformerConfig keyword arguments for the config's sliding window ({} when no layer slides).

    transformers lets query i see keys j with i - window < j <= i; Megatron's window_size=(left, 0) lets it see
    i - left <= j <= i, so left = window - 1. `window_attn_skip_freq` as a list marks each (global) layer that slides.
    """
    layers = sliding_window_layers(hf_config)
    if not layers:
        return {}
    return {"window_size": (int(hf_config.sliding_window) - 1, 0),
            "window_attn_skip_freq": [int(i in layers) for i in range(hf_config.num_hidden_layers)]}


def check_supported_options(hf_config: Any) -> None:
    """Raise a one-line ValueError naming the first config option the Megatron model cannot reproduce exactly."""
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; the MLP (and every expert) is SwiGLU "
                         f"(silu)")
    rope_settings(hf_config)
