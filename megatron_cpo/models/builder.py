"""Megatron-Core `GPTModel` built from a Hugging Face config of a registered family (models/families/).

The HF config is the single source of truth for the architecture: RMSNorm, SwiGLU, RoPE (theta, Llama-3 or linear
scaling), grouped-query attention, q/k norms, the family's biases and sliding window, mixtures of experts (with a
shared expert), tied or untied embeddings; options Megatron cannot reproduce exactly are refused (hf_options.py and
each family list every one). Tensor, pipeline and expert parallel sizes come from `megatron.core.parallel_state` (call
`megatron_cpo.platform.init_distributed` first). The vocabulary is padded only up to a multiple of the TP size (so each
rank holds an equal slice; checkpoints load whatever padding they were saved with); the model keeps the real size as
`model.hf_vocab_size` so callers can drop the padded logit columns.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from megatron_cpo import platform
from megatron_cpo.models.families import LinearBiases, family_of
from megatron_cpo.models.hf_options import check_supported_options, rope_settings, sliding_window_settings  # noqa: F401 (re-exported)
from megatron_cpo.models.value_head import ValueHead, head_has_bias


def load_hf_config(hf_dir: str | Path) -> Any:
    """Read `config.json` from an HF model directory, with an error that says what is missing."""
    from transformers import AutoConfig

    path = Path(hf_dir)
    if not (path / "config.json").is_file() and (path / "adapter_config.json").is_file():
        base = json.loads((path / "adapter_config.json").read_text()).get("base_model_name_or_path")
        raise FileNotFoundError(f"{str(path)!r} is a PEFT adapter, not a model: pass its base model ({base!r}) here; "
                                "LoRA training starts from the adapter with actor_rollout_ref.model.lora.adapter_path, "
                                "and `megatron-cpo merge-lora` merges it into the base")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(path)!r}; pass the directory of a Hugging Face model "
                                f"(one that AutoModelForCausalLM.from_pretrained loads)")
    return AutoConfig.from_pretrained(path)


def head_dim_of(hf_config: Any) -> int:
    """Per-head width: the config's `head_dim` when set (Qwen3-style configs), else hidden_size / heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def linear_biases(hf_config: Any) -> LinearBiases:
    """Which projections of the config's family carry a bias."""
    return family_of(hf_config).biases(hf_config)


def padded_vocab_size(vocab_size: int, tensor_model_parallel_size: int) -> int:
    """The smallest multiple of the TP size that holds `vocab_size` (each TP rank owns an equal vocab slice)."""
    return math.ceil(vocab_size / tensor_model_parallel_size) * tensor_model_parallel_size


def check_parallel_sizes(hf_config: Any, tensor_model_parallel_size: int, pipeline_model_parallel_size: int,
                         expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> None:
    """Raise a clear error when the heads, KV heads, layers or experts cannot be split over TP/PP/EP/ETP."""
    heads, kv_heads = hf_config.num_attention_heads, hf_config.num_key_value_heads
    layers = hf_config.num_hidden_layers
    tp, pp, ep = tensor_model_parallel_size, pipeline_model_parallel_size, expert_model_parallel_size
    etp = expert_tensor_parallel_size or tp
    if heads % tp:
        raise ValueError(f"TP={tp} does not divide num_attention_heads={heads}; choose a TP size that divides it")
    if kv_heads % tp:
        raise ValueError(f"TP={tp} does not divide num_key_value_heads={kv_heads}; choose a TP size that divides it")
    if layers % pp:
        raise ValueError(f"PP={pp} does not divide num_hidden_layers={layers}; choose a PP size that divides it")
    moe = family_of(hf_config).moe(hf_config)
    if moe is None:
        if ep > 1 or etp != tp:
            raise ValueError(f"EP={ep}, ETP={etp} split experts, but model_type={hf_config.model_type!r} is dense; "
                             f"set expert_model_parallel_size=1 and expert_tensor_parallel_size=null")
        return
    if moe.num_experts % ep:
        raise ValueError(f"EP={ep} does not divide the {moe.num_experts} experts; choose an expert-parallel size "
                         f"(expert_model_parallel_size, --ep) that divides it")
    if moe.expert_ffn_size % etp:
        raise ValueError(f"ETP={etp} does not divide the expert width moe_intermediate_size={moe.expert_ffn_size}; "
                         f"choose an expert_tensor_parallel_size that divides it")


def check_hf_config(hf_config: Any, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                    expert_model_parallel_size: int = 1, expert_tensor_parallel_size: int | None = None) -> None:
    """Every check that needs no process group: the family is supported, no option it cannot reproduce is set, and
    the model splits over the layout (one-line errors naming the value and the fix)."""
    family = family_of(hf_config)
    check_supported_options(hf_config)
    family.check(hf_config)
    check_parallel_sizes(hf_config, tensor_model_parallel_size, pipeline_model_parallel_size,
                         expert_model_parallel_size, expert_tensor_parallel_size)


def transformer_settings(hf_config: Any, params_dtype: torch.dtype = torch.float32) -> dict:
    """The `TransformerConfig` fields that make Megatron compute what transformers computes for `hf_config`, for the
    current TP/PP/EP/ETP sizes (no platform or run settings)."""
    from megatron.core import parallel_state

    family = family_of(hf_config)  # these three fail before any process group is needed
    check_supported_options(hf_config)
    family.check(hf_config)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    ep = parallel_state.get_expert_model_parallel_world_size()
    etp = parallel_state.get_expert_tensor_parallel_world_size()
    check_parallel_sizes(hf_config, tp, pp, ep, etp)
    biases = family.biases(hf_config)
    moe = family.moe(hf_config)
    settings = dict(
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
        add_bias_linear=biases.attention_output or biases.mlp,
        add_qkv_bias=biases.qkv,
        qk_layernorm=family.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=float(getattr(hf_config, "attention_dropout", 0.0) or 0.0),
        init_method_std=getattr(hf_config, "initializer_range", 0.02),
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        **sliding_window_settings(hf_config),
    )
    if moe is not None:
        settings.update(moe.transformer_settings(), moe_grouped_gemm=uses_transformer_engine())
    return settings


def transformer_config(hf_config: Any, params_dtype: torch.dtype = torch.float32, **options: Any):
    """Megatron `TransformerConfig` equivalent to the HF config, for the current TP/PP/EP sizes; `options` are further
    `TransformerConfig` fields that change how, not what, it computes (sequence parallelism, activation recompute,
    the MoE token dispatcher, a load-balancing loss); they override the defaults of `transformer_settings`."""
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(**{
        **transformer_settings(hf_config, params_dtype),
        "perform_initialization": True,
        "cuda_graph_scope": [],
        "bias_activation_fusion": False,
        "bias_dropout_fusion": False,
        "masked_softmax_fusion": False,
        "persist_layer_norm": False,
        "apply_rope_fusion": False,
        "gradient_accumulation_fusion": False,
        **platform.megatron_config_kwargs(),
        **options,
    })


def _without_bias(linear_class: type) -> type:
    """`linear_class` that never creates a bias, whatever `add_bias_linear` says (Megatron has one flag for both the
    attention output and the MLP; Llama has one per module)."""

    def __init__(self, *args, bias: bool = False, **kwargs):
        linear_class.__init__(self, *args, bias=False, **kwargs)

    return type(f"{linear_class.__name__}WithoutBias", (linear_class,), {"__init__": __init__})


class SequenceParallelRMSNorm:
    """The local spec's torch RMSNorm with its weight marked `sequence_parallel`, so sequence parallelism runs
    without Transformer Engine.

    Megatron's torch-norm wrapper refuses sequence parallelism only because it does not mark the weight: each TP rank
    then sees a different part of the sequence, and Megatron's `finalize_model_grads` all-reduces the gradients of
    weights marked `sequence_parallel` over TP (what its fused and TE norms declare).
    """

    def __new__(cls, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> torch.nn.Module:
        norm = torch.nn.RMSNorm(hidden_size, eps=eps)
        norm.weight.sequence_parallel = bool(config.sequence_parallel)
        return norm


def _one_layer_spec(config: Any, biases: LinearBiases | None, num_experts: int | None, attention_kind: str):
    """The spec of one dense (`num_experts` None) or MoE layer: Transformer Engine's when TE is importable (GPU),
    Megatron-Core's local one otherwise, with exactly the HF biases (see `layer_spec`) and the core attention of
    `attention_kind` (models/attention.py: `te`, `torch` or `local`)."""
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_cpo.models.attention import TorchFusedAttention

    kind = {"num_experts": num_experts, "moe_grouped_gemm": bool(num_experts) and config.moe_grouped_gemm,
            "qk_layernorm": config.qk_layernorm}
    if uses_transformer_engine():
        spec = get_gpt_layer_with_transformer_engine_spec(**kind)
    else:
        spec = get_gpt_layer_local_spec(normalization=config.normalization, **kind)
        if config.sequence_parallel:
            spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = SequenceParallelRMSNorm
            if config.qk_layernorm:  # per-head norms: Megatron sums their gradients over TP by name
                attention = spec.submodules.self_attention.submodules
                attention.q_layernorm = attention.k_layernorm = SequenceParallelRMSNorm
    if attention_kind != "te":  # the local spec's own, or torch's fused one (either spec's q/k/v feed it)
        core = TorchFusedAttention if attention_kind == "torch" else DotProductAttention
        spec.submodules.self_attention.submodules.core_attention = core
    if biases is not None and config.add_bias_linear:
        attention, mlp = spec.submodules.self_attention.submodules, spec.submodules.mlp.submodules
        if not biases.qkv:  # Megatron gives linear_qkv a bias when add_bias_linear or add_qkv_bias is on
            attention.linear_qkv = _without_bias(attention.linear_qkv)
        if not biases.attention_output:
            attention.linear_proj = _without_bias(attention.linear_proj)
        if not biases.mlp:  # MoE families refuse biased linears (the router would get one too)
            mlp.linear_fc1, mlp.linear_fc2 = _without_bias(mlp.linear_fc1), _without_bias(mlp.linear_fc2)
    return spec


def layer_spec(config: Any, biases: LinearBiases | None = None, core_attention: str | None = None):
    """The decoder spec: one layer spec when every layer is the same, else a block spec listing this stage's layers
    (dense and MoE layers per `config.moe_layer_freq`), with the core attention of kind `core_attention` (default:
    what `attention_backend=auto` gives here, `attention_kind`).

    Megatron's `add_bias_linear` covers the attention and the MLP linears together; when it is on for only one of them
    (Llama's `mlp_bias` without `attention_bias`, or the reverse), the other's linears are swapped for bias-free
    versions, so the model has exactly the HF biases. With sequence parallelism and no Transformer Engine every norm,
    the final one included, marks its weight (SequenceParallelRMSNorm).
    """
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    core_attention = core_attention or attention_kind("auto")
    routed = list(config.moe_layer_freq) if config.num_moe_experts else [0] * config.num_layers
    sequence_parallel_norms = config.sequence_parallel and not uses_transformer_engine()
    if not any(routed) and not sequence_parallel_norms:
        return _one_layer_spec(config, biases, None, core_attention)
    specs = {kind: _one_layer_spec(config, biases, config.num_moe_experts if kind else None, core_attention)
             for kind in set(routed)}
    offset = get_transformer_layer_offset(config)
    layers = [specs[kind] for kind in routed[offset:offset + transformer_block.get_num_layers_to_build(config)]]
    final_norm = SequenceParallelRMSNorm if sequence_parallel_norms else transformer_block.LayerNormImpl
    submodules = transformer_block.TransformerBlockSubmodules(layer_specs=layers, layer_norm=final_norm)
    return ModuleSpec(module=transformer_block.TransformerBlock, submodules=submodules)


def build_gpt_model(hf_config: Any, *, params_dtype: torch.dtype = torch.float32, value_head: bool = False,
                    attention_backend: str = "auto", **options: Any):
    """A Megatron `GPTModel` for this rank's TP slice and PP stage, randomly initialised, on `platform.device()`.

    Call `init_distributed` first. The model returns vocab-parallel logits (`parallel_output=True`), padded to
    `model.padded_vocab_size`; `model.hf_vocab_size` is the tokenizer's real vocabulary and `model.hf_config` the
    config it was built from. `options`: see `transformer_config`. `value_head` (the critic): the last stage's output
    layer is a scalar `ValueHead` instead (value_head.py; untied, with a bias when `hf_config` is a saved critic's), so
    the model returns `[b, s, 1]` values; `model.value_head` says which kind it is. `attention_backend` (Megatron's
    values, models/attention.py) chooses the core attention; `model.attention_kind` says which it got.
    """
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.enums import AttnBackend

    attention = attention_kind(attention_backend)
    if attention == "te" and attention_backend != "auto":  # Megatron tells Transformer Engine which kernel to use
        options = {**options, "attention_backend": AttnBackend[attention_backend]}
    config = transformer_config(hf_config, params_dtype, **options)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    vocab = padded_vocab_size(hf_config.vocab_size, tp)
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, family_of(hf_config).biases(hf_config), attention),
        vocab_size=vocab,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(),
        post_process=parallel_state.is_pipeline_last_stage(),
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)) and not value_head,
        position_embedding_type="rope",
        rotary_percent=1.0,
        **rope_settings(hf_config),
    )
    model.value_head = value_head
    model.attention_kind = attention
    if value_head and model.post_process:
        model.output_layer = ValueHead(config.hidden_size, head_has_bias(hf_config), config.sequence_parallel,
                                       params_dtype, platform.device())
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


def uses_transformer_engine() -> bool:
    """Whether models are built with the Transformer Engine layer spec (TE importable: GPU builds)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def attention_kind(attention_backend: str = "auto") -> str:
    """The core attention `attention_backend` gives on this machine: `te`, `torch` or `local` (models/attention.py)."""
    from megatron_cpo.models.attention import core_attention_kind

    return core_attention_kind(attention_backend, uses_transformer_engine())


def packing_layout(model: Any) -> str:
    """The packed layout (`rows` or `thd`, trainer/batch/packing.py) the model's core attention reads."""
    from megatron_cpo.models.attention import packing_layout as layout_for

    return layout_for(unwrap_model(model).attention_kind)


def decoder_hidden_states(model: Any, input_ids: torch.Tensor, position_ids: torch.Tensor,
                          attention_mask: torch.Tensor | None = None, packed_seq_params: Any = None) -> torch.Tensor:
    """`GPTModel.forward` without the output layer: `[s, b, h]` hidden states.

    On the last pipeline stage these are the final-norm states the lm-head would multiply (so a fused log-prob
    kernel can take them with `lm_head_weight` and never build the logits); on other stages they are exactly what
    `forward` returns and the pipeline sends on. Without a mask: causal attention over right-padded rows, as
    `forward(..., attention_mask=None)`. With `attention_mask` (`[b, 1, s, s]` bool, True = hidden; packed rows on the
    local attention) the rotary embedding is taken at each token's own `position_ids` (Megatron's RoPE otherwise uses
    the column index), so position ids that restart per packed sequence are honoured. `packed_seq_params` (THD:
    Transformer Engine's or torch's fused attention) is passed to Megatron, whose RoPE restarts per sequence itself.
    """
    gpt = unwrap_model(model)
    if gpt.mtp_process or gpt.config.fine_grained_activation_offloading:
        raise ValueError("the fused lm-head and packed paths support neither multi-token prediction nor fine-grained "
                         "activation offloading; set actor_rollout_ref.model.use_fused_kernels=false and "
                         "actor_rollout_ref.model.use_remove_padding=false")
    if attention_mask is not None and gpt.config.window_size is not None:
        raise ValueError("packed rows on the local attention cannot combine the per-sequence mask with a sliding "
                         "window; set actor_rollout_ref.model.use_remove_padding=false")
    preprocessed = gpt._preprocess(input_ids=input_ids, position_ids=position_ids,
                                   packed_seq_params=packed_seq_params)
    decoder_input, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin, sequence_len_offset, padding_mask = preprocessed[:6]
    if attention_mask is not None and rotary_pos_emb is not None:
        # [s, 1, 1, d] at columns 0..s-1 -> [s, b, 1, d] at each token's position id
        rotary_pos_emb = rotary_pos_emb[position_ids.transpose(0, 1).to(rotary_pos_emb.device)].squeeze(2)
    return gpt.decoder(
        hidden_states=decoder_input, attention_mask=attention_mask, rotary_pos_emb=rotary_pos_emb,
        rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
        rotary_pos_cos_sin=preprocessed[6] if len(preprocessed) == 7 else None,
        sequence_len_offset=sequence_len_offset, padding_mask=padding_mask, packed_seq_params=packed_seq_params)


def output_logits(model: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The last stage's vocab-parallel logits `[b, s, V_local]` from `decoder_hidden_states` (what `forward` returns);
    on other stages the hidden states themselves."""
    gpt = unwrap_model(model)
    if not gpt.post_process:
        return hidden_states
    weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(hidden_states, weight=weight)
    return logits.transpose(0, 1).contiguous()


def gather_sequence_parallel(model: Any, hidden_states: torch.Tensor) -> torch.Tensor:
    """The last stage's final hidden states over the whole sequence: with sequence parallelism each TP rank holds
    `s / TP` of them; the fused lm-head kernel needs them all (its backward all-reduces the hidden-state gradient
    over TP, so the gather's backward only keeps this rank's part)."""
    gpt = unwrap_model(model)
    if not gpt.config.sequence_parallel:
        return hidden_states
    from megatron.core import tensor_parallel

    return tensor_parallel.gather_from_sequence_parallel_region(hidden_states, tensor_parallel_output_grad=False)
