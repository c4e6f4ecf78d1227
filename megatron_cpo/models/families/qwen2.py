"""Qwen2 / Qwen2.5 (`model_type` qwen2): q/k/v always biased, optional sliding window on the upper layers."""
from __future__ import annotations

from typing import Any

from megatron_cpo.models.families.base import Family, LinearBiases
from megatron_cpo.models.hf_options import HONOURED, SLIDING_WINDOW_HOW, Option


class Qwen2(Family):
    model_type = "qwen2"
    label = "Qwen2/Qwen2.5"
    options = (
        Option("Qwen2 q/k/v bias", HONOURED, "always on for Qwen2 (its o_proj and MLP have no bias)"),
        Option("use_sliding_window, sliding_window, max_window_layers, layer_types (Qwen2)", HONOURED,
               SLIDING_WINDOW_HOW),
    )

    def biases(self, hf_config: Any) -> LinearBiases:
        return LinearBiases(qkv=True, attention_output=False, mlp=False)
