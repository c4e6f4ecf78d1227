"""`actor_rollout_ref.model.*`: the HF model the actor, the reference and the engines start from, and how the
Megatron model computes (fused log-prob kernel, padding-free packing, activation recompute)."""
from __future__ import annotations

from dataclasses import dataclass

# Megatron's (and verl's) `attention_backend` values; what each means here: models/attention.py.
ATTENTION_BACKENDS = ("auto", "flash", "fused", "unfused", "local")


@dataclass
class ModelConfig:
    """The HF model directory the actor, the reference and the rollout engines start from.

    `use_fused_kernels` (verl's name) computes the actor's and the reference's log-probs and entropy from the final
    hidden states and the vocab-parallel lm-head weight in one kernel, so the `[tokens, vocab]` logits are never
    materialised (the memory that dominates at long responses and a 152k vocabulary); the results are the same.
    `use_remove_padding` (verl's name) packs several sequences into each row of a micro-batch, position ids restarting
    and attention confined per sequence (THD packed sequences with Transformer Engine's and torch's fused attention, a
    per-sequence mask on the local one: `actor.megatron.attention_backend`), so no compute is spent on padding; with
    `actor.use_dynamic_bsz` the token budgets then count real tokens. `enable_gradient_checkpointing` recomputes
    activations in the backward (Megatron's recompute, as `actor.megatron.recompute_*` say): less memory, one more
    forward; the results are the same.
    """
    path: str = ""
    use_fused_kernels: bool = False
    use_remove_padding: bool = False
    enable_gradient_checkpointing: bool = False
