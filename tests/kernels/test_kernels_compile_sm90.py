"""The CUDA path compiles: every Triton kernel, with the shipped TritonBackend tile sizes, is compiled ahead of time
for an H100 (sm_90, bf16) with the ptxas that ships in the triton wheel. No GPU is needed or used; this only catches
what the interpreter cannot (compile errors, shared-memory overflow, matmuls that miss the tensor cores)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from megatron_cpo.kernels import TritonBackend, triton_kernels

HERE = Path(__file__).resolve().parent
H100 = GPUTarget("cuda", 90, 32)
H100_SHARED_MEMORY = 227 * 1024
CONFIG = TritonBackend()
ROW_STATS = {"max_ptr": "*fp32", "sum_exp_ptr": "*fp32", "sum_exp_shift_ptr": "*fp32", "target_z_ptr": "*fp32"}
ROW_GRADS = {"max_ptr": "*fp32", "lse_ptr": "*fp32", "entropy_ptr": "*fp32", "grad_lp_ptr": "*fp32",
             "grad_ent_ptr": "*fp32"}
TILES = {"BLOCK_N": CONFIG.block_n, "BLOCK_V": CONFIG.block_v, "BLOCK_K": CONFIG.block_k, "DOT_FP32": False}

KERNELS = {  # name: (kernel, runtime-argument types, constexprs, uses tl.dot)
    "logits_stats": (triton_kernels.logits_stats_kernel,
                     {"logits_ptr": "*bf16", "stride_row": "i32", "targets_ptr": "*i64", **ROW_STATS,
                      "n_valid": "i32", "inv_temp": "fp32"}, {"BLOCK_V": CONFIG.logits_block_v}, False),
    "logits_grad": (triton_kernels.logits_grad_kernel,
                    {"logits_ptr": "*bf16", "grad_ptr": "*bf16", "stride_row": "i32", "stride_grad": "i32",
                     "targets_ptr": "*i64", **ROW_GRADS, "n_valid": "i32", "n_cols": "i32", "inv_temp": "fp32"},
                    {"BLOCK_V": CONFIG.logits_block_v}, False),
    "linear_stats": (triton_kernels.linear_stats_kernel,
                     {"hidden_ptr": "*bf16", "weight_ptr": "*bf16", "targets_ptr": "*i64", **ROW_STATS,
                      "num_tokens": "i32", "n_valid": "i32", "hidden_size": "i32", "stride_h": "i32",
                      "stride_w": "i32", "tiles_per_split": "i32", "inv_temp": "fp32"}, TILES, True),
    "linear_grad_logits": (triton_kernels.linear_grad_logits_kernel,
                           {"hidden_ptr": "*bf16", "weight_ptr": "*bf16", "grad_ptr": "*bf16", "targets_ptr": "*i64",
                            **ROW_GRADS, "num_tokens": "i32", "n_valid": "i32", "n_cols": "i32",
                            "hidden_size": "i32", "stride_h": "i32", "stride_w": "i32", "stride_g": "i32",
                            "inv_temp": "fp32"}, TILES, True),
}


def compile_all() -> dict[str, dict]:
    """Compile every kernel for sm_90; runs in a process without TRITON_INTERPRET (the interpreter replaces @jit)."""
    results = {}
    for name, (kernel, arg_types, constexprs, uses_dot) in KERNELS.items():
        signature = {**arg_types, **{key: "constexpr" for key in constexprs}}
        options = {"num_warps": CONFIG.num_warps, "num_stages": CONFIG.num_stages} if uses_dot else {}
        compiled = triton.compile(ASTSource(kernel, signature, constexprs=constexprs), target=H100, options=options)
        results[name] = {"cubin": "cubin" in compiled.asm, "shared": compiled.metadata.shared,
                         "wgmma": "wgmma" in compiled.asm["ptx"]}
    return results


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_DEFAULT_FP_FUSION="1", PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parents[1])]))
    code = "import json, test_kernels_compile_sm90 as t; print(json.dumps(t.compile_all()))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", KERNELS)
def test_kernel_compiles_for_h100(compiled, name):
    result = compiled[name]
    assert result["cubin"]
    assert result["shared"] <= H100_SHARED_MEMORY
    if KERNELS[name][3]:
        assert result["wgmma"], "the tile matmul should use Hopper's warpgroup tensor-core MMA"
