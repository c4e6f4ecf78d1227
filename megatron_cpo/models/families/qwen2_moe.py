"""Qwen2-MoE / Qwen1.5-MoE (`model_type` qwen2_moe): Qwen2 attention (q/k/v bias as `qkv_bias` says), routed
experts plus one shared expert whose output a sigmoid gate scales."""
from __future__ import annotations

from typing import Any

from megatron_cpo.models.families.base import Family, LinearBiases, MoeLayout, refuse_router_options
from megatron_cpo.models.families.qwen3_moe import QWEN_MOE_OPTIONS, qwen_moe_layout
from megatron_cpo.models.hf_options import HONOURED, SLIDING_WINDOW_HOW, Option
from megatron_cpo.models.tensor_rules import ExpertNames


class Qwen2Moe(Family):
    model_type = "qwen2_moe"
    label = "Qwen2-MoE"
    expert_names = ExpertNames(shared_expert="shared_expert.", shared_expert_gate="shared_expert_gate.weight")
    options = (
        Option("qkv_bias (Qwen2-MoE)", HONOURED, "q/k/v bias (add_qkv_bias); o_proj and the MLPs have none"),
        *QWEN_MOE_OPTIONS,
        Option("shared_expert_intermediate_size, shared expert gate (Qwen2-MoE)", HONOURED,
               "moe_shared_expert_intermediate_size with moe_shared_expert_gate: the shared expert's output times "
               "sigmoid(shared_expert_gate(x)), added to the routed experts'"),
        Option("use_sliding_window, sliding_window, max_window_layers, layer_types (Qwen2-MoE)", HONOURED,
               SLIDING_WINDOW_HOW),
    )

    def biases(self, hf_config: Any) -> LinearBiases:
        return LinearBiases(qkv=bool(getattr(hf_config, "qkv_bias", True)), attention_output=False, mlp=False)

    def moe(self, hf_config: Any) -> MoeLayout | None:
        return qwen_moe_layout(hf_config, shared_expert_size=hf_config.shared_expert_intermediate_size)

    def check(self, hf_config: Any) -> None:
        if not hf_config.shared_expert_intermediate_size:
            raise ValueError(f"shared_expert_intermediate_size={hf_config.shared_expert_intermediate_size} is not "
                             f"supported: Qwen2-MoE's shared expert needs a positive width")
        refuse_router_options(hf_config, self.label)
