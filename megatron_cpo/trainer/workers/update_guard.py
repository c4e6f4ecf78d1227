"""A non-finite value never reaches the weights: an optimizer step whose loss or gradient norm is NaN or infinite on
any rank is skipped on every rank, and too many skips in a row stop the run, naming where the first non-finite
value of the step appeared (`FiniteProbe`). Why Megatron's own step is split up: docs/trainer.md.
"""
from __future__ import annotations

import logging
import math
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform

logger = logging.getLogger(__name__)

STAGES = ("rewards", "log-probs", "values", "advantages", "loss", "gradients")
"""Where a non-finite value can appear in a step, in the order the data flows through them."""

_HINTS = {
    "rewards": "the scores the advantages are computed from (with verl's KL in the reward, the log-probs' KL term)",
    "log-probs": "the model's forward pass (weights, or activations that overflow params_dtype)",
    "values": "the critic's forward pass (its weights, or activations that overflow params_dtype)",
    "advantages": "the advantage estimator or the shaper",
    "loss": "a term of the loss (importance ratio, KL, entropy) on finite log-probs and advantages",
    "gradients": "the backward pass (e.g. gradients that overflow: lower the learning rate or train in float32)",
}


class FiniteProbe:
    """One flag per stage of `STAGES`, set when a value observed there was NaN or infinite; kept on the device."""

    def __init__(self, flags: torch.Tensor | None = None) -> None:
        self.flags = flags if flags is not None else torch.zeros(len(STAGES), device=platform.device())

    def observe(self, stage: str, values: torch.Tensor | None, mask: torch.Tensor | None = None) -> None:
        """Flag `stage` when any of `values` (where `mask` is true) is not finite; None: nothing to observe."""
        if values is None:
            return
        bad = ~torch.isfinite(values.detach())
        if mask is not None:
            bad &= mask.to(bad.device, torch.bool)
        index = STAGES.index(stage)
        self.flags[index] = torch.maximum(self.flags[index], bad.any().to(self.flags.device, self.flags.dtype))

    def for_update(self) -> FiniteProbe:
        """A probe for one optimizer step of this step: what the step saw so far, plus what the update sees."""
        return FiniteProbe(self.flags.clone())


def clip_gradients(optimizer: Any, grad_norm: float) -> None:
    """Scale the main gradients to the configured `clip_grad` of each (chained) optimizer by the total norm, as
    Megatron's own `step` does."""
    from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

    for inner in getattr(optimizer, "chained_optimizers", [optimizer]):
        params = [] if getattr(inner, "is_stub_optimizer", False) else inner.get_parameters()
        if params and inner.config.clip_grad > 0:
            clip_grad_by_total_norm_fp32(params, inner.config.clip_grad, grad_norm,
                                         inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8)


class UpdateGuard:
    """Runs a model's optimizer steps (`step`) so that none applies a non-finite value, and counts the skipped ones.

    `model`: how messages name the model ("actor"); `max_consecutive`: skipped steps in a row after which
    `exhausted` holds; `setting`: the dotted name of that limit, for the messages."""

    def __init__(self, model: str, max_consecutive: int, setting: str) -> None:
        self.model = model
        self.max_consecutive = max_consecutive
        self.setting = setting
        self.consecutive = 0
        self.first_stages: list[str] = []  # what the first skipped step of the current run of skips saw

    def step(self, optimizer: Any, probe: FiniteProbe) -> tuple[bool, float]:
        """Collective (every rank of the model): Megatron's optimizer step, unless the loss or the gradient norm is
        not finite on some rank, then none at all; (applied, gradient norm)."""
        found_inf = optimizer.prepare_grads()  # the gradients into the main ones (fp16: unscaled and checked)
        grad_norm = float(optimizer.get_grad_norm())
        flags = probe.flags.clone()
        flags[STAGES.index("gradients")] = float(bool(found_inf) or not math.isfinite(grad_norm))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        seen = [stage for stage, flag in zip(STAGES, flags.tolist()) if flag]
        if "loss" in seen or "gradients" in seen:
            self._skipped(seen)
            return False, grad_norm
        self.consecutive, self.first_stages = 0, []
        clip_gradients(optimizer, grad_norm)
        optimizer.step_with_ready_grads()
        return True, grad_norm

    def _skipped(self, seen: list[str]) -> None:
        self.consecutive += 1
        if self.consecutive == 1:
            self.first_stages = seen
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.warning("%s update skipped on every rank: non-finite %s (first: %s); the weights are unchanged "
                           "(%d skipped in a row; %s=%d stops the run)", self.model, ", ".join(seen), seen[0],
                           self.consecutive, self.setting, self.max_consecutive)

    @property
    def exhausted(self) -> bool:
        """Whether `max_consecutive` steps in a row were skipped."""
        return self.consecutive >= self.max_consecutive

    def abort_message(self, step: int) -> str:
        """One line for the run's end: how many skips, where the first non-finite value appeared, what to look at."""
        first, *rest = self.first_stages
        then = f" (then in the {', '.join(rest)})" if rest else ""
        return (f"{self.consecutive} {self.model} updates in a row were skipped for non-finite values, the last at "
                f"step {step}: the first non-finite value appeared in the {first}{then}, so look at "
                f"{_HINTS[first]}; the weights are those of the last applied update ({self.setting}="
                f"{self.max_consecutive} allows more skips in a row)")
