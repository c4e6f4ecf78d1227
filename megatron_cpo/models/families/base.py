"""What a model family is: the interface every supported HF architecture implements (models/families/*.py).

A family turns its HF config into the Megatron model's architecture (biases, q/k norms, mixture-of-experts layout),
names the HF tensors of each layer (tensor_rules.py mappings) and refuses, in one line, every config option the
Megatron model cannot reproduce. The builder, the weight mapping, the converters, the engine export and
tools/plan_memory.py read it; nothing else in the package branches on `model_type`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_cpo.models.hf_options import Option
from megatron_cpo.models.tensor_rules import (
    ExpertNames,
    Mapping,
    attention_rules,
    dense_mlp_rules,
    moe_rules,
    post_attention_norm_rule,
)


@dataclass(frozen=True)
class LinearBiases:
    """Which projections carry a bias: q/k/v, the attention output (o_proj) and the MLP (gate/up and down)."""

    qkv: bool
    attention_output: bool
    mlp: bool


@dataclass(frozen=True)
class MoeLayout:
    """The mixture-of-experts part of a config: which layers route, over how many experts, and how.

    `moe_layers[i]` is 1 when layer i is a MoE layer (0: a dense MLP of `intermediate_size`); `normalize_top_k`:
    the top-k routing probabilities are renormalised to sum to 1 (Megatron: softmax over the top-k logits, i.e.
    `moe_router_pre_softmax=False`), else they are the softmax over all experts (`moe_router_pre_softmax=True`)."""

    num_experts: int
    top_k: int
    expert_ffn_size: int
    moe_layers: tuple[int, ...]
    normalize_top_k: bool
    shared_expert_size: int | None = None
    shared_expert_gate: bool = False

    def transformer_settings(self) -> dict:
        """`TransformerConfig` fields of this layout. Load balancing is off (no auxiliary loss, as verl, slime and
        NeMo-RL train RL) and the router computes in float32 like transformers' router softmax; the trainer may
        override both."""
        return {"num_moe_experts": self.num_experts, "moe_router_topk": self.top_k,
                "moe_ffn_hidden_size": self.expert_ffn_size, "moe_layer_freq": list(self.moe_layers),
                "moe_router_pre_softmax": not self.normalize_top_k,
                "moe_shared_expert_intermediate_size": self.shared_expert_size,
                "moe_shared_expert_gate": self.shared_expert_gate,
                "moe_router_load_balancing_type": "none", "moe_aux_loss_coeff": 0.0, "moe_router_dtype": "fp32"}


class Family:
    """One supported HF architecture, registered under its `model_type` (families/__init__.py).

    Subclasses set the class attributes and override what differs; every method takes the HF config."""

    model_type: str = ""
    label: str = ""                          # the models it covers, for messages and docs
    qk_norm: bool = False                    # per-head RMSNorm of queries and keys (Qwen3)
    expert_names: ExpertNames | None = None  # MoE families: where the MoE block's tensors live
    options: tuple[Option, ...] = ()         # this family's rows of the option audit (docs/conversion.md)

    def biases(self, hf_config: Any) -> LinearBiases:
        """Llama-style flags: `attention_bias` for q/k/v and o_proj, `mlp_bias` for gate/up/down."""
        attention = bool(getattr(hf_config, "attention_bias", False))
        return LinearBiases(qkv=attention, attention_output=attention, mlp=bool(getattr(hf_config, "mlp_bias", False)))

    def moe(self, hf_config: Any) -> MoeLayout | None:
        """The mixture-of-experts layout (None: a dense model)."""
        return None

    def check(self, hf_config: Any) -> None:
        """Raise a one-line ValueError naming the first family-specific option the Megatron model cannot reproduce
        (the options common to every family are checked by hf_options.check_supported_options)."""

    def layer_rules(self, hf_config: Any, layer_index: int) -> tuple[Mapping, ...]:
        """The mappings of layer `layer_index` (global, from 0): attention, then a dense MLP or the MoE block."""
        rules = attention_rules(self.qk_norm) + (post_attention_norm_rule(),)
        moe = self.moe(hf_config)
        if moe is not None and moe.moe_layers[layer_index]:
            return rules + moe_rules(self.expert_names)
        return rules + dense_mlp_rules()


def sparse_layers(hf_config: Any, num_experts: int) -> tuple[int, ...]:
    """Qwen-MoE's choice of MoE layers: layer i routes unless it is in `mlp_only_layers`, when there are experts and
    (i + 1) is a multiple of `decoder_sparse_step`."""
    step = int(getattr(hf_config, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(hf_config, "mlp_only_layers", None) or ())
    return tuple(int(i not in dense and num_experts > 0 and (i + 1) % step == 0)
                 for i in range(hf_config.num_hidden_layers))


def refuse_router_options(hf_config: Any, label: str) -> None:
    """Options of HF MoE routers that Megatron's top-k router does not have."""
    jitter = float(getattr(hf_config, "router_jitter_noise", 0.0) or 0.0)
    if jitter:
        raise ValueError(f"router_jitter_noise={jitter} is not supported: it randomises the {label} training forward "
                         f"(the update's log-probs would not equal the rollout's); set it to 0")
