"""`params_dtype: auto` (megatron_cpo/compute_dtype.py): bf16 only where the machine multiplies it natively.

The CPUs this suite runs on cannot be changed, so the rule is checked three ways: on this machine as it is; in a
fresh interpreter whose oneDNN is capped at AVX2 (`ONEDNN_MAX_CPU_ISA=AVX2`: an AVX-512 machine computing as an
AVX2-only CPU does, the way benchmarks/real_model/bench_dtype.py measures that kind); and with torch's capability
query answering as a CPU with bf16 instructions would (a stand-in for hardware this machine does not have: the only
mock here, and only of that query).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_cpo import compute_dtype
from megatron_cpo.compute_dtype import bf16_support, resolve_dtype
from megatron_cpo.config_checks import ConfigError
from megatron_cpo.trainer.config import MegatronConfig

SETTING = "actor_rollout_ref.actor.megatron.params_dtype"


@pytest.fixture
def fresh_support():
    """`bf16_support` is cached per process; these tests change what it reads, so it is asked again."""
    bf16_support.cache_clear()
    yield
    bf16_support.cache_clear()


@pytest.mark.parametrize("name", ["float32", "bfloat16", "float16"])
def test_an_explicit_dtype_keeps_its_meaning(name):
    chosen = resolve_dtype(name)
    assert (chosen.name, chosen.requested) == (name, name)
    assert MegatronConfig(params_dtype=name).compute_dtype == name


def test_auto_follows_the_cpus_bf16_instructions_here():
    capabilities = torch.cpu.get_capabilities()
    has_instructions = any(capabilities.get(name) for name in ("avx512_bf16", "amx_bf16", "bf16"))
    chosen = resolve_dtype("auto")
    if not has_instructions:  # e.g. an AVX-512 CPU without AVX512-BF16, where oneDNN still "supports" bf16
        assert chosen.name == "float32" and "lacks" in chosen.reason
    assert chosen.name in ("float32", "bfloat16")
    assert MegatronConfig(params_dtype="auto").compute_dtype == chosen.name
    assert chosen.describe(SETTING) == f"{chosen.name} ({SETTING}=auto: {chosen.reason})"


def test_a_bad_dtype_names_the_choices():
    with pytest.raises(ConfigError, match=r"params_dtype='bf16' is not supported; choose one of 'auto', 'float32'"):
        MegatronConfig(params_dtype="bf16")


def test_bf16_instructions_that_onednn_may_use_are_native(fresh_support, monkeypatch):
    """Stand-in: torch's capability query answers as on a CPU with AVX512-BF16 (this one has none)."""
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", "avx512_bf16": True})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    native = torch.ops.mkldnn._is_mkldnn_bf16_supported()  # oneDNN's own check of this machine (AVX-512 or not)
    assert resolve_dtype("auto").name == ("bfloat16" if native else "float32")
    assert (resolve_dtype("bfloat16").warning(SETTING) is None) == native
    for cap in ("AVX512_CORE", "avx512_core_vnni", "AVX2"):  # oneDNN capped below its bf16 instructions
        bf16_support.cache_clear()
        monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
        assert resolve_dtype("auto").name == "float32"
        assert f"ONEDNN_MAX_CPU_ISA={cap.upper()}" in resolve_dtype("auto").reason


def test_explicit_bf16_without_native_bf16_warns_with_the_slowdown_and_the_fix(fresh_support, monkeypatch):
    monkeypatch.setattr(torch.cpu, "get_capabilities", lambda: {"architecture": "x86_64", "avx512_f": True})
    warning = resolve_dtype("bfloat16").warning(SETTING)
    slowdown = (compute_dtype.SLOWDOWN_EMULATED if torch.ops.mkldnn._is_mkldnn_bf16_supported()
                else compute_dtype.SLOWDOWN_UNSUPPORTED)
    assert warning.startswith(f"{SETTING}=bfloat16 on a machine without native bf16 (the CPU lacks avx512_bf16 or "
                              "amx_bf16)")
    assert f"measured {slowdown:g}x slower than in float32" in warning
    assert warning.endswith(f"set {SETTING}=auto (or float32) for full speed")
    assert "\n" not in warning
    assert resolve_dtype("auto").warning(SETTING) is None and resolve_dtype("float32").warning(SETTING) is None


def test_an_avx2_capped_onednn_reads_as_a_cpu_without_bf16():
    """A fresh interpreter (oneDNN reads its cap once) with ONEDNN_MAX_CPU_ISA=AVX2: oneDNN's bf16 check says no,
    `auto` takes float32 and an explicit bf16 warns with the AVX2 slowdown."""
    code = ("import json; from megatron_cpo.compute_dtype import resolve_dtype, bf16_support; import torch; "
            "print(json.dumps([torch.ops.mkldnn._is_mkldnn_bf16_supported(), resolve_dtype('auto').name, "
            "resolve_dtype('bfloat16').warning('x')]))")
    environment = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2"}
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True, text=True, check=True)
    onednn_bf16, auto, warning = json.loads(done.stdout.strip().splitlines()[-1])
    assert onednn_bf16 is False and auto == "float32"
    assert f"measured {compute_dtype.SLOWDOWN_UNSUPPORTED:g}x slower" in warning
