"""Make vLLM's CPU mixture-of-experts layers prepack the weights of every reload, not only of the first load.

vLLM 0.32 runs the experts' `process_weights_after_loading` only when it builds the MoE kernel, so reloaded experts
stayed in checkpoint layout and gave wrong log-probs silently (docs/launch.md's table of derived state).
`prepack_cpu_experts_on_reload(model)` re-runs that step on every reload; idempotent, other layers untouched.
"""
from __future__ import annotations

from typing import Any

import torch


def _cpu_unquantized_method(module: torch.nn.Module) -> Any | None:
    """The module's unquantized fused-MoE method if its kernel runs vLLM's CPU unquantized experts, else None."""
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    method = getattr(module, "quant_method", None)
    if not isinstance(method, UnquantizedFusedMoEMethod) or method.moe_kernel is None:
        return None
    return method if isinstance(method.moe_kernel.fused_experts, CPUUnquantizedExperts) else None


def _with_experts_step(method: Any) -> None:
    from vllm.model_executor.utils import is_weights_pre_processed

    process = method.process_weights_after_loading

    def process_weights_after_loading(layer: torch.nn.Module) -> None:
        reload = method.moe_kernel is not None and not is_weights_pre_processed()  # vLLM then skips the experts' step
        process(layer)
        if reload:
            method.moe_kernel.fused_experts.process_weights_after_loading(layer)

    method.process_weights_after_loading = process_weights_after_loading
    method.prepacks_on_reload = True


def prepack_cpu_experts_on_reload(model: torch.nn.Module) -> int:
    """Wrap every CPU unquantized MoE layer of `model` (see the module docstring); returns how many were wrapped now."""
    wrapped = 0
    for module in model.modules():
        method = _cpu_unquantized_method(module)
        if method is not None and not getattr(method, "prepacks_on_reload", False):
            _with_experts_step(method)
            wrapped += 1
    return wrapped
