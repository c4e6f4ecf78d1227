"""`params_dtype: auto`: compute in bfloat16 where this machine multiplies it natively, in float32 elsewhere.

Emulated bf16 is slower than float32 (a SmolLM2 forward 2.2x on AVX-512 without AVX512-BF16, 4.1x on AVX2:
benchmarks/real_model/README.md), so a CPU counts as native only when its instructions have bf16 *and* oneDNN
may use them (`ONEDNN_MAX_CPU_ISA`); a GPU asks `torch.cuda.is_bf16_supported(including_emulation=False)`.
"""
from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass

DTYPES = ("float32", "bfloat16", "float16")
PARAMS_DTYPES = ("auto", *DTYPES)
# oneDNN's ISA caps (ONEDNN_MAX_CPU_ISA, or its older name DNNL_MAX_CPU_ISA) that leave out the bf16 instructions
ONEDNN_ISAS_WITHOUT_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")
# a SmolLM2-sized forward's bf16 time over its float32 time where bf16 is not native (the docstring's measurements):
# oneDNN's emulation (AVX-512), torch's own kernels (no oneDNN bf16: AVX2)
SLOWDOWN_EMULATED, SLOWDOWN_UNSUPPORTED = 2.2, 4.1


@dataclass(frozen=True)
class Bf16Support:
    """Whether this machine multiplies bf16 natively, the check that says so (for the run's log), and where it does
    not, how much slower than float32 a model's forward ran in bf16 on such a machine."""
    native: bool
    why: str
    slowdown: float = 1.0


@functools.cache
def bf16_support() -> Bf16Support:
    """Native bf16 on this machine's GPU, or on its CPU when it has no GPU (see the module docstring)."""
    import torch  # here: loading a config (which names `PARAMS_DTYPES`) imports no torch

    if torch.cuda.is_available():
        native = torch.cuda.is_bf16_supported(including_emulation=False)
        return Bf16Support(native, f"{torch.cuda.get_device_name()} {'has' if native else 'lacks'} bf16 arithmetic")
    capabilities = torch.cpu.get_capabilities()
    found = [name for name in ("avx512_bf16", "amx_bf16", "bf16") if capabilities.get(name)]
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "").upper()
    emulated = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())  # False under a cap below AVX-512 too
    slowdown = SLOWDOWN_EMULATED if emulated else SLOWDOWN_UNSUPPORTED
    if not found:
        expected = "bf16" if capabilities.get("architecture") == "aarch64" else "avx512_bf16 or amx_bf16"
        return Bf16Support(False, f"the CPU lacks {expected}", slowdown)
    if cap in ONEDNN_ISAS_WITHOUT_BF16 or not emulated:
        why = f"the CPU has {found[0]}, but oneDNN may not use it (ONEDNN_MAX_CPU_ISA={cap or 'unset'})"
        return Bf16Support(False, why, slowdown)
    return Bf16Support(True, f"the CPU has {found[0]}")


@dataclass(frozen=True)
class ComputeDtype:
    """The dtype a run computes in (`name`: float32, bfloat16 or float16), the setting's value that chose it
    (`requested`, `auto` included) and why."""
    requested: str
    name: str
    reason: str

    def describe(self, setting: str) -> str:
        """One line for the run's start and `--dry-run`: the dtype, the setting that chose it and why."""
        return f"{self.name} ({setting}={self.requested}: {self.reason})"

    def warning(self, setting: str) -> str | None:
        """One line when `setting` asks for bfloat16 explicitly on a machine without native bf16, else None."""
        support = bf16_support()
        if self.requested != "bfloat16" or support.native:
            return None
        measured = (f": a model's forward measured {support.slowdown:g}x slower than in float32 on such a CPU"
                    if support.slowdown > 1 else "")
        return (f"{setting}=bfloat16 on a machine without native bf16 ({support.why}), so bf16 is emulated{measured}; "
                f"set {setting}=auto (or float32) for full speed")

    def announce(self, log: logging.Logger, what: str, setting: str) -> None:
        """Log at start which dtype `what` computes in and why, and the slow-bf16 warning when it applies."""
        log.info("%s compute in %s", what, self.describe(setting))
        warning = self.warning(setting)
        if warning:
            log.warning(warning)


def resolve_dtype(requested: str) -> ComputeDtype:
    """`requested` (one of `PARAMS_DTYPES`) as this machine runs it: `auto` becomes bfloat16 where bf16 is native,
    float32 elsewhere; any other name stays itself."""
    if requested != "auto":
        return ComputeDtype(requested, requested, "as configured")
    support = bf16_support()
    return ComputeDtype(requested, "bfloat16" if support.native else "float32", support.why)
