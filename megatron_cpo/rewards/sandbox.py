"""Run untrusted Python (model-written code) behind an operating-system boundary.

Holds the settings in use and the dispatcher (``run_python``) over the backends ``reward.sandbox.mode`` chooses:
``namespaces`` (sandbox_launcher.py), ``remote`` (sandbox_fusion.py), ``process`` (weak) or ``auto``. No Python-level
guard is part of the boundary. What each backend enforces: docs/sandbox.md.
"""
from __future__ import annotations

import functools
import logging
import os

from megatron_cpo.rewards.sandbox_fusion import run_remote
from megatron_cpo.rewards.sandbox_namespaces import namespaces_unavailable_reason, run_namespaced
from megatron_cpo.rewards.sandbox_process import run_in_process
from megatron_cpo.rewards.sandbox_types import SandboxConfig, SandboxLimits, SandboxResult

logger = logging.getLogger(__name__)

_settings = SandboxConfig()


def configure_sandbox(settings: SandboxConfig, resolve: bool = True) -> str | None:
    """Set the backend every later ``run_python`` call of this process uses; returns the resolved mode (``resolve``
    False leaves ``auto``'s probe to the first run)."""
    global _settings
    _settings = settings
    return active_mode() if resolve else None


def current_settings() -> SandboxConfig:
    return _settings


def active_mode() -> str:
    """The backend in use: ``namespaces``, ``process`` or ``remote`` (``auto`` resolved, and logged once)."""
    return _resolve(_settings.mode, bool(_settings.fusion_url))


@functools.cache
def _resolve(mode: str, has_url: bool) -> str:
    if mode == "auto":
        reason = namespaces_unavailable_reason()
        mode = "remote" if has_url else ("namespaces" if reason is None else "process")
        logger.info("code sandbox: reward.sandbox.mode=auto runs the %r backend", mode)
    elif mode == "namespaces" and (reason := namespaces_unavailable_reason()) is not None:
        raise RuntimeError(f"reward.sandbox.mode=namespaces, but this machine refuses them ({reason}); run the "
                           "grader as root (or with CAP_SYS_ADMIN), or set reward.sandbox.mode=remote with "
                           "reward.sandbox.fusion_url, or knowingly reward.sandbox.mode=process")
    if mode == "process":
        logger.warning(
            "CODE SANDBOX IS WEAK: reward.sandbox.mode resolved to 'process' (no namespaces here: %s). Model-written "
            "code runs with rlimits only and can see this machine's files and network%s. Use "
            "reward.sandbox.mode=namespaces (root / CAP_SYS_ADMIN) or remote (reward.sandbox.fusion_url) for "
            "untrusted code; reward/sandbox_weak=1 is logged every step.", namespaces_unavailable_reason(),
            "" if os.geteuid() == 0 else ", and as the trainer's own user, can read and signal its processes")
    return mode


def sandbox_metrics() -> dict[str, float]:
    """``reward/sandbox_weak``: 1 when code runs in the weak process mode."""
    return {"reward/sandbox_weak": float(active_mode() == "process")}


def run_python(program: str, stdin: str = "", *, limits: SandboxLimits | None = None, mode: str = "stdio",
               fn_name: str | None = None, backend: str | None = None) -> SandboxResult:
    """Run ``program`` once in the configured sandbox (``backend`` overrides it for this call). mode ``stdio`` feeds
    ``stdin``; mode ``call`` calls ``fn_name`` with the JSON argument list in ``stdin`` and returns its JSON result
    on stdout."""
    if mode not in ("stdio", "call") or (mode == "call" and not fn_name):
        raise ValueError(f"run_python mode={mode!r}, fn_name={fn_name!r}: use mode='stdio', or 'call' with fn_name")
    limits = limits or SandboxLimits()
    backend = backend or active_mode()
    if backend == "namespaces":
        return run_namespaced(program, stdin, limits, mode, fn_name)
    if backend == "process":
        return run_in_process(program, stdin, limits, mode, fn_name)
    if backend == "remote":
        return run_remote(program, stdin, limits, mode, fn_name, _settings)
    raise ValueError(f"sandbox backend={backend!r}; choose namespaces, process or remote")
