"""`actor_rollout_ref.model.*`: the HF model the actor, the reference and the engines start from, how the Megatron
model computes (fused log-prob kernel, padding-free packing, activation recompute), and its LoRA adapters
(`model.lora.*`, models/lora/)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from megatron_cpo.config_checks import check, check_choice

LORA_TARGETS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""Megatron's names of the linear layers an adapter can sit on (verl's and Megatron-Bridge's default targets)."""


@dataclass
class LoraConfig:
    """LoRA adapters on the model's linear layers (verl's Megatron keys, Megatron-Bridge's meaning): each targeted
    layer computes `W x + (alpha / rank) * B A x`, with `W` frozen in its dtype and only `A` [rank, in] and `B`
    [out, rank] trained; the reference policy is the same model with its adapters off. `rank` 0 is off.

    `target_modules`: Megatron's layer names (`linear_qkv`, `linear_proj`, `linear_fc1`, `linear_fc2`; in a mixture
    of experts `linear_fc1` / `linear_fc2` also name each routed expert's), Hugging Face's (`q_proj`/`k_proj`/
    `v_proj` together, `o_proj`, `gate_proj`/`up_proj` together, `down_proj`), `all-linear`, or fnmatch patterns over
    the layer's full Megatron name (`*.layers.0.*.linear_qkv`); `exclude_modules` removes layers the same way.
    `lora_A_init_method`: `xavier` (normal, Megatron-Bridge's default) or `kaiming` (uniform, PEFT's); B starts at
    zero, so the model starts as the base. `dropout` (at `dropout_position` `pre`: on the adapter's input, `post`: on
    its output) acts in training only. `adapter_path`: a PEFT adapter directory to start from (one this trainer
    exported, or one PEFT saved for the same base), of this `rank`. `merge`: the weight push sends merged weights
    (`W + (alpha / rank) B A`, the only push here: see docs/lora.md). `SECTION` names the section for the messages
    (the critic's adapters extend this class).
    """
    SECTION: ClassVar[str] = "actor_rollout_ref.model.lora"
    rank: int = 0
    alpha: float = 32.0
    dropout: float = 0.0
    dropout_position: str = "pre"
    target_modules: list[str] = field(default_factory=lambda: list(LORA_TARGETS))
    exclude_modules: list[str] = field(default_factory=list)
    lora_A_init_method: str = "xavier"
    merge: bool = True
    adapter_path: str | None = None

    def __post_init__(self) -> None:
        prefix = self.SECTION + "."
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        if isinstance(self.exclude_modules, str):
            self.exclude_modules = [self.exclude_modules]
        self.exclude_modules = [name for name in self.exclude_modules or [] if name]  # verl's FSDP default: null
        check(isinstance(self.rank, int) and self.rank >= 0,
              f"{prefix}rank={self.rank!r} must be an integer > 0 (0: no adapters); e.g. 32")
        check(self.alpha > 0, f"{prefix}alpha={self.alpha} must be > 0 (the adapter's scale is alpha / rank)")
        self.alpha = float(self.alpha)
        check(0 <= self.dropout < 1, f"{prefix}dropout={self.dropout} must be in [0, 1)")
        check_choice(prefix + "dropout_position", self.dropout_position, ("pre", "post"))
        check_choice(prefix + "lora_A_init_method", self.lora_A_init_method, ("xavier", "kaiming"))
        check(bool(self.target_modules), f"{prefix}target_modules is empty; name the layers to adapt, e.g. "
                                         f"{list(LORA_TARGETS)} or all-linear")
        check(self.merge, f"{prefix}merge=false pushes adapters alone to vLLM (enable_lora), which the engines "
                          "here do not do; set merge=true (the push sends W + alpha/rank B A; docs/lora.md)")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        """What the adapter's output is multiplied by: alpha / rank (PEFT's and Megatron-Bridge's scale)."""
        return self.alpha / self.rank

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
    forward; the results are the same. `lora`: train LoRA adapters instead of the whole model (`LoraConfig`,
    docs/lora.md).
    """
    path: str = ""
    use_fused_kernels: bool = False
    use_remove_padding: bool = False
    enable_gradient_checkpointing: bool = False
    lora: LoraConfig = field(default_factory=LoraConfig)
