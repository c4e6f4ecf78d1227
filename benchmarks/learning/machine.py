"""The CPU a benchmark's timings come from, read from /proc/cpuinfo (no torch): one reader for the learning table,
the real-model comparisons and the attention benchmark."""
from __future__ import annotations

import os
from pathlib import Path

# the flags that decide what a CPU computes fast: float32 width (avx2 / avx512f) and native bf16 (`params_dtype: auto`)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def machine_record() -> dict:
    """The CPU's model name ('' where /proc/cpuinfo has none), the flags of `CPU_FLAGS` it has, its core count, and
    the oneDNN ISA cap (which turns native bf16 off, so `auto` computes in float32 on a bf16 CPU too)."""
    model, flags = "", set()
    cpuinfo = Path("/proc/cpuinfo")
    for line in cpuinfo.read_text().splitlines() if cpuinfo.is_file() else ():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and not model:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"cpu": model, "cpu_flags": [flag for flag in CPU_FLAGS if flag in flags], "cores": os.cpu_count(),
            "ONEDNN_MAX_CPU_ISA": os.environ.get("ONEDNN_MAX_CPU_ISA", "")}


def describe_machine(record: dict) -> str:
    """'<CPU> (<flags>, <cores> cores[, oneDNN cap])' of a run.json's last attempt; 'not recorded' before the runner
    kept it."""
    machine = (record.get("attempts") or [{}])[-1].get("machine")
    if not machine:
        return "not recorded"
    cap = f", ONEDNN_MAX_CPU_ISA={machine['ONEDNN_MAX_CPU_ISA']}" if machine.get("ONEDNN_MAX_CPU_ISA") else ""
    return f"{machine['cpu']} ({' '.join(machine['cpu_flags']) or 'none of ' + '/'.join(CPU_FLAGS)}, " \
           f"{machine['cores']} cores{cap})"
