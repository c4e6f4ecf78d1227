"""The supported model families, one module each, registered by Hugging Face `model_type` (base.py: the interface).

Adding a family: a module with a `Family` subclass (its biases, q/k norms, MoE layout, HF tensor names, refusals and
option-audit rows), registered below; the contract tests (tests/foundation) then build its tiny model and check it.
"""
from __future__ import annotations

from typing import Any

from megatron_cpo.models.families.base import Family, LinearBiases, MoeLayout
from megatron_cpo.models.families.llama import Llama
from megatron_cpo.models.families.mixtral import Mixtral
from megatron_cpo.models.families.qwen2 import Qwen2
from megatron_cpo.models.families.qwen2_moe import Qwen2Moe
from megatron_cpo.models.families.qwen3 import Qwen3
from megatron_cpo.models.families.qwen3_moe import Qwen3Moe

FAMILIES: dict[str, Family] = {family.model_type: family for family in
                               (Qwen2(), Llama(), Qwen3(), Qwen3Moe(), Qwen2Moe(), Mixtral())}

# Architectures users ask for that are knowingly not supported, with what is missing.
REFUSED_MODEL_TYPES = {
    "deepseek_v3": "DeepSeek-V3 needs multi-latent attention with YaRN mscale, sigmoid routing with expert bias and "
                   "node-limited (group) top-k, its multi-token-prediction layer and block-FP8 checkpoints in the HF "
                   "<-> Megatron mapping; none is implemented here yet",
}


def family_of(hf_config: Any) -> Family:
    """The registered family of an HF config, or a one-line error naming the architecture and the supported ones."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ValueError(f"model_type={model_type!r} is not supported: {REFUSED_MODEL_TYPES[model_type]}")
    if model_type not in FAMILIES:
        labels = ", ".join(f"{name} ({family.label})" for name, family in FAMILIES.items())
        raise ValueError(f"unsupported architecture model_type={model_type!r} "
                         f"(architectures={getattr(hf_config, 'architectures', None)}); supported: {labels}")
    return FAMILIES[model_type]


__all__ = ["FAMILIES", "REFUSED_MODEL_TYPES", "Family", "LinearBiases", "MoeLayout", "family_of"]
