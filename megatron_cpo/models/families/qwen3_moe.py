"""Qwen3-MoE, e.g. Qwen3-30B-A3B and 235B-A22B (`model_type` qwen3_moe): Qwen3 attention, routed experts.

transformers 5.19 keeps the experts fused in memory (`experts.gate_up_proj` [E, 2I, H]) but saves and loads them per
expert (`mlp.experts.{e}.gate_proj.weight`...), the names vLLM loads too; those are the names here.
"""
from __future__ import annotations

from typing import Any

from megatron_cpo.models.families.base import Family, MoeLayout, refuse_router_options, sparse_layers
from megatron_cpo.models.families.qwen3 import QK_NORM
from megatron_cpo.models.hf_options import HONOURED, NO_EFFECT, REFUSED, Option
from megatron_cpo.models.tensor_rules import ExpertNames

QWEN_MOE_OPTIONS = (
    Option("num_experts (num_local_experts), num_experts_per_tok, moe_intermediate_size", HONOURED,
           "num_moe_experts, moe_router_topk, moe_ffn_hidden_size"),
    Option("norm_topk_prob", HONOURED, "renormalised top-k probabilities: moe_router_pre_softmax = not "
                                       "norm_topk_prob (top-k of the logits, then softmax over them)"),
    Option("decoder_sparse_step, mlp_only_layers", HONOURED,
           "moe_layer_freq as a per-layer list: layer i routes unless in mlp_only_layers, when (i + 1) is a "
           "multiple of decoder_sparse_step; the others are dense MLPs of intermediate_size"),
    Option("router_aux_loss_coef, output_router_logits", NO_EFFECT,
           "transformers' auxiliary loss, added to its loss only; the trainer's load-balancing loss is off by "
           "default (moe_router_load_balancing_type='none', moe_aux_loss_coeff=0)"),
)


def qwen_moe_layout(hf_config: Any, shared_expert_size: int | None = None) -> MoeLayout | None:
    """The layout of a Qwen2-MoE / Qwen3-MoE config (None when no layer routes)."""
    num_experts = int(getattr(hf_config, "num_experts", 0) or 0)
    layers = sparse_layers(hf_config, num_experts)
    if not any(layers):
        return None
    return MoeLayout(num_experts=num_experts, top_k=hf_config.num_experts_per_tok,
                     expert_ffn_size=hf_config.moe_intermediate_size, moe_layers=layers,
                     normalize_top_k=bool(hf_config.norm_topk_prob), shared_expert_size=shared_expert_size,
                     shared_expert_gate=shared_expert_size is not None)


class Qwen3Moe(Family):
    model_type = "qwen3_moe"
    label = "Qwen3-MoE"
    qk_norm = True
    expert_names = ExpertNames()
    options = (QK_NORM, Option("attention_bias (Qwen3-MoE)", f"{HONOURED} / {REFUSED}",
                               "false only: Megatron's add_bias_linear would also give the router a bias"),
               *QWEN_MOE_OPTIONS,
               Option("use_sliding_window, sliding_window (Qwen3-MoE)", HONOURED,
                      "every layer slides when use_sliding_window (the Qwen2 window rule, no max_window_layers)"))

    def moe(self, hf_config: Any) -> MoeLayout | None:
        return qwen_moe_layout(hf_config)

    def check(self, hf_config: Any) -> None:
        if getattr(hf_config, "attention_bias", False):
            raise ValueError("attention_bias=True is not supported for Qwen3-MoE: Megatron-Core's add_bias_linear "
                             "would also give the experts and the router biases the checkpoint does not have")
        refuse_router_options(hf_config, self.label)
