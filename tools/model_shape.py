"""The dimensions of an HF model that decide memory and FLOPs (tools/plan_memory.py), dense or mixture-of-experts.

Read from `config.json` through the model family registry (megatron_cpo/models/families/), so the planner counts the
parameters the Megatron model of that family has: q/k norms, biases, and for MoE families the router, the routed
experts of the layers that route and the shared expert. A mixture of experts has two sizes: the total (what memory
and weight pushes hold) and the active parameters per token (what the FLOPs use: the top-k experts of each MoE
layer, not all of them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class ModelShape:
    """The dimensions that decide memory and FLOPs. `num_experts` 0: a dense model; else `moe_layers` of the
    `num_layers` route each token to `top_k` of `num_experts` experts of width `expert_ffn`, plus an always-on shared
    expert of width `shared_expert_ffn` (0: none) with an optional gate."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    tied_embeddings: bool
    qkv_bias: bool
    attention_output_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    top_k: int = 0
    expert_ffn: int = 0
    moe_layers: int = 0
    shared_expert_ffn: int = 0
    shared_expert_gate: bool = False

    @classmethod
    def from_hf_config(cls, config: dict) -> ModelShape:
        """From an HF `config.json` dict of a supported family (read through transformers' config class, so aliases
        such as Qwen3-MoE's num_local_experts / num_experts resolve)."""
        from transformers import AutoConfig

        from megatron_cpo.models.families import family_of

        fields = {key: value for key, value in config.items() if key not in ("model_type", "transformers_version")}
        hf = AutoConfig.for_model(config.get("model_type", "qwen2"), **fields)
        family = family_of(hf)
        biases, moe = family.biases(hf), family.moe(hf)
        heads = hf.num_attention_heads
        shape = cls(vocab_size=hf.vocab_size, hidden_size=hf.hidden_size, num_layers=hf.num_hidden_layers,
                    num_heads=heads, num_kv_heads=getattr(hf, "num_key_value_heads", None) or heads,
                    head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // heads,
                    intermediate_size=hf.intermediate_size,
                    tied_embeddings=bool(getattr(hf, "tie_word_embeddings", False)), qkv_bias=biases.qkv,
                    attention_output_bias=biases.attention_output, mlp_bias=biases.mlp, qk_norm=family.qk_norm)
        if moe is not None:
            shape.num_experts, shape.top_k, shape.expert_ffn = moe.num_experts, moe.top_k, moe.expert_ffn_size
            shape.moe_layers = sum(moe.moe_layers)
            shape.shared_expert_ffn = moe.shared_expert_size or 0
            shape.shared_expert_gate = moe.shared_expert_gate
        return shape

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def attention_params(self, tp: int = 1) -> float:
        """One layer's attention and both norms on one TP rank (norms are replicated)."""
        attention = self.hidden_size * self.qkv_width + self.num_heads * self.head_dim * self.hidden_size
        split_bias = self.qkv_width if self.qkv_bias else 0
        replicated = 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)  # norms (and o_proj's bias)
        return (attention + split_bias) / tp + replicated + (self.hidden_size if self.attention_output_bias else 0)

    def dense_mlp_params(self, tp: int = 1) -> float:
        """One dense SwiGLU MLP on one TP rank (the gate/up biases split, the down bias replicated)."""
        weights = 3 * self.hidden_size * self.intermediate_size
        if not self.mlp_bias:
            return weights / tp
        return (weights + 2 * self.intermediate_size) / tp + self.hidden_size

    def expert_params(self) -> int:
        """One routed expert (SwiGLU: gate, up, down)."""
        return 3 * self.hidden_size * self.expert_ffn

    def moe_shared_params(self, tp: int = 1) -> float:
        """What every rank of a MoE layer holds besides the routed experts: router, shared expert and its gate."""
        shared = 3 * self.hidden_size * self.shared_expert_ffn / tp
        return self.hidden_size * self.num_experts + shared + (self.hidden_size if self.shared_expert_gate else 0)

    def layer_params(self, tp: int = 1) -> float:
        """Parameters of one dense transformer layer on one TP rank."""
        return self.attention_params(tp) + self.dense_mlp_params(tp)

    def _embeddings(self) -> int:
        return self.vocab_size * self.hidden_size * (1 if self.tied_embeddings else 2) + self.hidden_size

    def total_params(self) -> int:
        """All parameters of the model (one copy of a tied embedding)."""
        dense = self.num_layers - self.moe_layers
        moe = self.moe_layers * (self.attention_params() + self.moe_shared_params()
                                 + self.num_experts * self.expert_params())
        return int(dense * self.layer_params() + moe + self._embeddings())

    def active_params(self) -> int:
        """Parameters one token goes through: all of a dense model; of a MoE model, `top_k` experts per MoE layer."""
        return self.total_params() - self.moe_layers * (self.num_experts - self.top_k) * self.expert_params()

    def stage_layers(self, pp: int) -> tuple[int, int]:
        """(dense, MoE) layers of the largest pipeline stage, counting as many MoE layers as a stage can get."""
        per_stage = math.ceil(self.num_layers / pp)
        moe = min(per_stage, self.moe_layers)
        return per_stage - moe, moe

    def stage_params(self, tp: int, pp: int, padded_vocab: int, ep: int = 1, etp: int | None = None) -> dict:
        """Parameters on the GPU of the largest pipeline stage: {"dense": ..., "experts": ...} (experts are split
        over EP x ETP ranks and sharded by the optimizer over the expert-data-parallel ranks)."""
        dense_layers, moe_layers = self.stage_layers(pp)
        dense = dense_layers * self.layer_params(tp) + moe_layers * (self.attention_params(tp)
                                                                     + self.moe_shared_params(tp))
        experts = moe_layers * self.num_experts / ep * self.expert_params() / (etp or tp)
        embedding = padded_vocab * self.hidden_size / tp
        dense += (embedding * (1 if self.tied_embeddings else 2) if pp == 1 else embedding) + self.hidden_size
        return {"dense": dense, "experts": experts}
