"""Whether a vLLM engine can sleep between rollouts, and the one log line when it cannot.

Sleep mode frees an engine's device memory while colocated training runs (level 1: KV cache freed, weights to host;
level 2: weights discarded). It needs vLLM's CuMem allocator, enabled at engine start, on CUDA, ROCm or XPU only;
elsewhere (the CPU build) a sleep or wake-up does nothing and the engine says why once.
"""
from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

_explained: set[int] = set()  # engines (by index) that have logged why they do not sleep


def platform_supports_sleep() -> bool:
    """vLLM's own answer for this machine (False for the CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()


def why_not_sleeping(enabled: bool, platform_supported: bool) -> str | None:
    """None when the engine can sleep; otherwise what a sleep / wake-up request will do instead."""
    if not platform_supported:
        return ("vLLM has no sleep mode on this platform, so the engine keeps its memory; sleep and wake-up do "
                "nothing")
    if not enabled:
        return ("the engine was started without sleep mode (actor_rollout_ref.rollout.free_cache_engine=false), so "
                "it keeps its memory; sleep and wake-up do nothing")
    return None


def explain_once(engine_index: int, reason: str) -> None:
    """Log `reason` the first time engine `engine_index` is asked to sleep or wake without being able to."""
    if engine_index not in _explained:
        _explained.add(engine_index)
        logger.info("engine %d: %s", engine_index, reason)
