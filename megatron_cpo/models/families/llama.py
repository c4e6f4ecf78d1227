"""Llama 2/3 and models of its shape, e.g. SmolLM2 (`model_type` llama): optional attention and MLP biases."""
from __future__ import annotations

from megatron_cpo.models.families.base import Family
from megatron_cpo.models.hf_options import HONOURED, NO_EFFECT, Option


class Llama(Family):
    model_type = "llama"
    label = "Llama"
    options = (
        Option("attention_bias (Llama)", HONOURED, "q/k/v bias (add_qkv_bias) and o_proj bias (linear_proj bias)"),
        Option("mlp_bias (Llama)", HONOURED, "gate/up bias (linear_fc1 bias) and down bias (linear_fc2 bias); either "
                                             "bias flag alone keeps the other module bias-free"),
        Option("pretraining_tp", NO_EFFECT, "transformers 5 ignores it (older versions split matmuls; same result)"),
    )
