"""Mixtral (`model_type` mixtral): Llama-style attention without biases, every layer a mixture of experts.

The checkpoint (and vLLM) name the MoE block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up) and
w2 (down). The router takes the softmax over all experts, keeps the top k and renormalises them: the softmax over the
top-k logits, Megatron's `moe_router_pre_softmax=False` (the logits test fails with True).
"""
from __future__ import annotations

from typing import Any

from megatron_cpo.models.families.base import Family, MoeLayout, refuse_router_options
from megatron_cpo.models.hf_options import HONOURED, NO_EFFECT, REFUSED, Option
from megatron_cpo.models.tensor_rules import ExpertNames


class Mixtral(Family):
    model_type = "mixtral"
    label = "Mixtral"
    expert_names = ExpertNames(block="block_sparse_moe.", projections=("w1", "w3", "w2"))
    options = (
        Option("num_local_experts, num_experts_per_tok, intermediate_size (Mixtral)", HONOURED,
               "num_moe_experts, moe_router_topk, moe_ffn_hidden_size; every layer routes"),
        Option("Mixtral top-k renormalisation", HONOURED, "always on: moe_router_pre_softmax=False"),
        Option("router_jitter_noise", f"{HONOURED} / {REFUSED}",
               "0 only: other values randomise the training forward"),
        Option("router_aux_loss_coef, output_router_logits (Mixtral)", NO_EFFECT,
               "transformers' auxiliary loss only; the trainer's load-balancing loss is off by default"),
        Option("sliding_window (Mixtral)", HONOURED, "every layer slides when set"),
    )

    def moe(self, hf_config: Any) -> MoeLayout | None:
        return MoeLayout(num_experts=hf_config.num_local_experts, top_k=hf_config.num_experts_per_tok,
                         expert_ffn_size=hf_config.intermediate_size,
                         moe_layers=(1,) * hf_config.num_hidden_layers, normalize_top_k=True)

    def check(self, hf_config: Any) -> None:
        refuse_router_options(hf_config, self.label)
