"""Megatron-Core `GPTModel` built from a Hugging Face config of the Qwen2 or Llama family.

The HF config is the single source of truth for the architecture: RMSNorm, SwiGLU, RoPE (theta and Llama-3 scaling),
grouped-query attention, Qwen2's qkv bias, tied or untied embeddings. Tensor and pipeline sizes come from
`megatron.core.parallel_state` (call `megatron_cpo.platform.init_distributed` first). The vocabulary is padded only
up to a multiple of the TP size (so each rank holds an equal slice); the model keeps the real size as
`model.hf_vocab_size` so callers can drop the padded logit columns.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_cpo import platform


@dataclass(frozen=True)
class Family:
    """What distinguishes one supported HF architecture from another, as far as the Megatron model is concerned."""

    name: str
    qkv_bias_attribute: str | None  # HF config attribute that turns the q/k/v bias on, or None when always on
    always_qkv_bias: bool = False


FAMILIES = {
    "qwen2": Family("qwen2", qkv_bias_attribute=None, always_qkv_bias=True),
    "llama": Family("llama", qkv_bias_attribute="attention_bias"),
}

# Megatron-Core's Llama-3 RoPE scaling hard-codes these; configs that differ would silently get other frequencies.
_MEGATRON_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def load_hf_config(hf_dir: str | Path) -> Any:
    """Read `config.json` from an HF model directory, with an error that says what is missing."""
    from transformers import AutoConfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}; pass the directory of a Hugging Face model "
                                f"(one that AutoModelForCausalLM.from_pretrained loads)")
    return AutoConfig.from_pretrained(path)


def family_of(hf_config: Any) -> Family:
    """The supported family of an HF config, or a clear error naming the architecture."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported architecture model_type={model_type!r} "
                         f"(architectures={getattr(hf_config, 'architectures', None)}); supported: "
                         f"{sorted(FAMILIES)} (Qwen2/Qwen2.5 and Llama families)")
    return FAMILIES[model_type]


def head_dim_of(hf_config: Any) -> int:
    """Per-head width: the config's `head_dim` when set (Qwen3-style configs), else hidden_size / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def has_qkv_bias(hf_config: Any) -> bool:
    """Whether q/k/v projections carry a bias (always for Qwen2, `attention_bias` for Llama)."""
    family = family_of(hf_config)
    if family.always_qkv_bias:
        return True
    return bool(getattr(hf_config, family.qkv_bias_attribute, False))


def rope_settings(hf_config: Any) -> dict:
    """GPTModel keyword arguments for the config's RoPE (theta and optional Llama-3 scaling)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    legacy_scaling = getattr(hf_config, "rope_scaling", None) or {}
    if not params:
        params = {"rope_theta": getattr(hf_config, "rope_theta", 10000.0), **legacy_scaling}
    rope_type = params.get("rope_type", params.get("type", "default"))
    settings = {"rotary_base": params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)),
                "rope_scaling": False}
    if rope_type == "default":
        return settings
    if rope_type == "llama3":
        mismatched = {k: params.get(k) for k, v in _MEGATRON_LLAMA3_ROPE.items() if float(params.get(k, v)) != v}
        if mismatched:
            raise ValueError(f"llama3 RoPE scaling with {mismatched} is not supported; Megatron-Core implements "
                             f"only {_MEGATRON_LLAMA3_ROPE}")
        return {**settings, "rope_scaling": True, "rope_scaling_factor": float(params["factor"])}
    raise ValueError(f"unsupported RoPE scaling rope_type={rope_type!r}; supported: 'default', 'llama3'")


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """The smallest multiple of the TP size that holds `vocab_size` (each TP rank owns an equal vocab slice)."""
    return math.ceil(vocab_size / tensor_model_parallel_size) * tensor_model_parallel_size


def check_parallel_sizes(hf_config: Any, tensor_model_parallel_size: int, pipeline_model_parallel_size: int) -> None:
    """Raise a clear error when the heads, KV heads or layers cannot be split over TP/PP."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    layers = hf_config.num_hidden_layers
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    if heads % tp:
        raise ValueError(f"TP={tp} does not divide num_attention_heads={heads}; choose a TP size that divides it")
    if kv_heads % tp:
        raise ValueError(f"TP={tp} does not divide num_key_value_heads={kv_heads}; choose a TP size that divides it")
    if layers % pp:
        raise ValueError(f"PP={pp} does not divide num_hidden_layers={layers}; choose a PP size that divides it")


def transformer_config(hf_config: Any, params_dtype: torch.dtype = torch.float32):
    """Megatron `TransformerConfig` equivalent to the HF config, for the current TP/PP sizes."""
    from megatron.core import parallel_state
    from megatron.core.transformer import TransformerConfig

    family_of(hf_config)
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r} is not supported; the Qwen2/Llama MLP is SwiGLU (silu)")
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    check_parallel_sizes(hf_config, tp, pp)
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim_of(hf_config),
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        perform_initialization=True,
        cuda_graph_scope=[],
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        **platform.megatron_config_kwargs(),
    )


def layer_spec(config: Any):
    """Transformer Engine layer spec when TE is importable (GPU), Megatron-Core's local spec otherwise."""
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)

    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return get_gpt_layer_local_spec(normalization=config.normalization)
    return get_gpt_layer_with_transformer_engine_spec()


def build_gpt_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32):
    """A Megatron `GPTModel` for this rank's TP slice and PP stage, randomly initialised, on `platform.device()`.

    Call `init_distributed` first. The model returns vocab-parallel logits (`parallel_output=True`), padded to
    `model.padded_vocab_size`; `model.hf_vocab_size` is the tokenizer's real vocabulary and `model.hf_config` the
    config it was built from.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    config = transformer_config(hf_config, params_dtype)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = padded_vocab_size(hf_config.vocab_size, tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config),
        vocab_size=vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_percent=1.0,
        **rope_settings(hf_config),
    )
    model.hf_config = hf_config
    model.hf_vocab_size = hf_config.vocab_size
    model.padded_vocab_size = vocab
    return model.to(device=platform.device(), dtype=params_dtype)


def unwrap_model(model: Any) -> Any:
    """The `GPTModel` inside Megatron's wrappers (DistributedDataParallel, Float16Module), or `model` itself."""
    while not hasattr(model, "hf_config") and hasattr(model, "module"):
        model = model.module
    if not hasattr(model, "hf_config"):
        raise TypeError(f"{type(model).__name__} was not built by build_gpt_model (it has no hf_config)")
    return model


def lm_head_weight(model: Any) -> torch.Tensor:
    """The last stage's vocab-parallel output weight `[V_local, H]`, the one `GPTModel.forward` multiplies: the output
    layer's, or with tied embeddings the shared weight (the embedding's when this stage also embeds)."""
    gpt = unwrap_model(model)
    if gpt.share_embeddings_and_output_weights:
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def decoder_hidden_states(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """`GPTModel.forward` without the output layer: `[s, b, h]` hidden states.

    On the last pipeline stage these are the final-norm states the lm-head would multiply (so a fused log-prob
    kernel can take them with `lm_head_weight` and never build the logits); on other stages they are exactly what
    `forward` returns and the pipeline sends on. Causal attention over right-padded rows, as `forward(...,
    attention_mask=None)`.
    """
    gpt = unwrap_model(model)
    if gpt.mtp_process or gpt.config.fine_grained_activation_offloading:
        raise ValueError("the fused lm-head path supports neither multi-token prediction nor fine-grained activation "
                         "offloading; set actor_rollout_ref.model.use_fused_kernels=false")
    preprocessed = gpt._preprocess(input_ids=input_ids, position_ids=position_ids)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = preprocessed[:6]
    return gpt.decoder(
        hidden_states=decoder_input, attention_mask=None, rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=preprocessed[6] if len(preprocessed) == 7 else None,
        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask)
