"""The GPU check's CPU side: the script says in one line that there is no GPU, and its pieces run at tiny shapes.

`bash scripts/gpu_check.sh --cpu-smoke` runs every part the GPU run runs (kernel correctness on the Triton
interpreter and the chunked torch path, the Megatron actor through the trainer's own step on gloo with a tiny model,
the actor's offload round trip, the kernel grid, plan_memory.py, the JSON and Markdown writers) and installs a wheel
from the wheel folder offline, so CI proves the script is not broken. The numbers it prints at tiny shapes are not
measurements.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import actor_bench, report, wheels
from benchmarks.gpu.kernel_grid import add_ratios, cells

ROOT = Path(__file__).resolve().parents[2]


def _probe_wheel(folder: Path) -> Path:
    """A minimal pure-python wheel (one module), to show the offline install without any network or index."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "gpu_check_probe-0.1-py3-none-any.whl"
    info = "gpu_check_probe-0.1.dist-info"
    files = {"gpu_check_probe/__init__.py": "VALUE = 42\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for name, content in files.items():
            archive.writestr(name, content)
    return path


def _run_script(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHON": sys.executable, **env}, timeout=600)


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would run the real check")
def test_without_a_gpu_the_script_says_so_in_one_line_and_exits_2(tmp_path):
    proc = _run_script("--out", str(tmp_path / "out"), env={"GPU_CHECK_WHEELS": str(tmp_path / "none")})
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and proc.stderr.startswith("gpu_check: skipped: no CUDA GPU")
    assert not (tmp_path / "out").exists()


@pytest.mark.multiprocess
def test_cpu_smoke_runs_every_part_and_writes_json_and_markdown(tmp_path):
    wheel_dir = tmp_path / "wheels"
    _probe_wheel(wheel_dir)
    out = tmp_path / "results"
    proc = _run_script("--cpu-smoke", "--out", str(out), env={"GPU_CHECK_WHEELS": str(wheel_dir)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "installing 1 wheel(s) offline" in proc.stdout
    assert (wheel_dir / "site" / "gpu_check_probe" / "__init__.py").read_text() == "VALUE = 42\n"
    assert wheels.plan(wheel_dir).to_install == []  # marked installed: a second run installs nothing

    summary = json.loads((out / "results.json").read_text())
    parts = summary["parts"]
    actor_parts = [f"actor_{mode}" for mode in ("padded", "token_budget", "packed", "fused_lm_head",
                                                 "token_budget_local")]
    assert {name: part["status"] for name, part in parts.items()} == {
        "kernel_correctness": "ok", "attention_correctness": "ok", **dict.fromkeys(actor_parts, "ok"),
        "actor_offload": "ok", "kernel_grid": "ok"}
    correctness = parts["kernel_correctness"]["records"]
    # 2 kernels x 2 dtypes x 2 cases, on the interpreted Triton backend and the chunked torch backend
    assert len(correctness) == 16 and all(r["passed"] for r in correctness)
    kernels = ("log_probs_and_entropy", "linear_log_probs_and_entropy")
    assert {(r["backend"], r["kernel"]) for r in correctness} == {
        (b, k) for b in ("triton-interpreted", "torch") for k in kernels}
    attention = parts["attention_correctness"]["records"]  # 2 dtypes x padded / packed x with / without a window
    assert len(attention) == 8 and all(r["passed"] for r in attention)
    assert {r["path"] for r in attention} == {"padded", "per_sequence"}  # no variable-length kernel on CPU
    actor = [record for name in actor_parts for record in parts[name]["records"]]
    assert [(r["mode"], r["phase"]) for r in actor][:2] == [("padded", "log_probs"), ("padded", "update")]
    assert {r["attention"] for r in actor if r["mode"] != "token_budget_local"} == {"torch"}
    assert {r["attention"] for r in actor if r["mode"] == "token_budget_local"} == {"local"}
    for record in actor:
        assert 0 < record["real_tokens"] < record["padded_positions"]  # log-normal lengths: padding exists
        assert record["real_tokens_per_s"] == pytest.approx(record["real_tokens"] / record["seconds"])
        assert record["plan_memory_gib"] > 0 and record["plan_seconds"] > 0 and math_finite(record["loss"])
    (offload,) = parts["actor_offload"]["records"]  # the CPU run: a separate host copy, no allocator figures
    assert offload["identical"] and offload["next_step_identical"] and offload["storages_released"]
    assert offload["offloaded_gib"] == pytest.approx(offload["params_gib"] + offload["grads_gib"]
                                                     + offload["optimizer_gib"]) and offload["allocated_gib"] is None
    grid = parts["kernel_grid"]["records"]
    assert {r["method"] for r in grid} == {"matmul", "fused_linear", "torch_linear", "fused_logits", "torch_logits"}
    assert all(r["status"] == "ok" for r in grid)

    markdown = (out / "results.md").read_text()
    for name in parts:
        assert f"## {name}" in markdown
    assert markdown.count("| triton-interpreted |") == 8
    assert markdown.count("| padded | torch |") == sum(r["mode"] == "padded" for r in actor) == 2  # actor rows
    # the trainer's other modes are picked up from the config as they land (token budgets, packing, fused lm-head)
    assert {r["mode"] for r in actor} == {"padded", "token_budget", "packed", "fused_lm_head", "token_budget_local"}
    plans = {r["mode"]: r["plan_memory_gib"] for r in actor}
    assert plans["token_budget"] > plans["padded"]  # the plan counts the mode's micro-batches of the token budget
    assert plans["token_budget_local"] > plans["token_budget"]  # the local attention's scores


def math_finite(value) -> bool:
    return value is not None and abs(value) < float("inf")


def test_markdown_table_and_jsonl_reader(tmp_path):
    columns = [("method", "method", report.text), ("ms", "ms", report.fmt(2)), ("note", "note", report.text)]
    table = report.markdown_table([{"method": "a|b", "ms": 1.234}, {"method": "c", "note": "x"}], columns)
    assert table == "| method | ms | note |\n|---|---|---|\n| a/b | 1.23 |  |\n| c |  | x |"
    path = tmp_path / "part.jsonl"
    report.append_record(path, {"a": 1})
    report.append_record(path, {"a": 2})
    with open(path, "a") as f:
        f.write('{"a": 3')  # a writer killed mid-line
    assert report.read_records(path) == [{"a": 1}, {"a": 2}]
    assert report.read_records(tmp_path / "missing.jsonl") == []


def test_wheel_plan_and_fetch_command(tmp_path):
    assert wheels.plan(tmp_path / "absent").to_install == []
    for name in ("megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl", "liger_kernel-0.8.5-py3-none-any.whl"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "notes.txt").write_text("not a wheel")
    plan = wheels.plan(tmp_path)
    assert [w.name for w in plan.to_install] == ["liger_kernel-0.8.5-py3-none-any.whl",
                                                  "megatron_core-0.16.1-cp312-cp312-manylinux_2_28_x86_64.whl"]
    command = wheels.pip_command(plan, python="py")
    assert command[:6] == ["py", "-m", "pip", "install", "--no-index", "--no-deps"]
    assert command[command.index("--target") + 1] == str(tmp_path / "site")
    assert wheels.fetch_hint(["megatron-core==0.16.1"]) == (
        "pip download megatron-core==0.16.1 --python-version 3.12 --platform manylinux_2_28_x86_64 "
        "--only-binary=:all: --no-deps -d .whl")


def test_actor_flops_modes_and_peaks_by_hand():
    # 1 layer, hidden 4, 2 heads of 2, 1 KV head, MLP 8, vocab 10: matmul parameters per layer
    # q 4x4 + k,v 4x2 each + o 4x4 + MLP 3x4x8 = 16 + 16 + 16 + 96 = 144, plus the lm-head 10x4 = 40 -> 184;
    # causal attention 2 x 1 layer x 4 x s^2. One sequence of 3 tokens: 2 x 184 x 3 + 8 x 9 = 1176.
    model = dict(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1)
    assert actor_bench.forward_flops(model, [3]) == 1176.0
    assert actor_bench.forward_flops(model, [3, 1]) == 1176.0 + 2 * 184 + 8
    names = {"actor_rollout_ref.model.use_fused_kernels", "actor_rollout_ref.actor.use_dynamic_bsz",
             "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"}
    assert [m.name for m in actor_bench.offered_modes(set())] == ["padded"]
    # each mode adds to the one before: the fused lm-head runs on packed rows, so it waits for packing
    assert [m.name for m in actor_bench.offered_modes(names)] == ["padded", "token_budget"]
    everything = names | {"actor_rollout_ref.model.use_remove_padding",
                          "actor_rollout_ref.actor.megatron.attention_backend"}
    assert [m.name for m in actor_bench.offered_modes(everything)] == [
        "padded", "token_budget", "packed", "fused_lm_head", "token_budget_local"]
    token_budget = actor_bench.MODES[1]
    assert actor_bench.mode_overrides(token_budget, names, 9000) == [
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=9000"]
    assert actor_bench.peak_tflops("NVIDIA H100 80GB HBM3", None) == 989.0
    assert actor_bench.peak_tflops("NVIDIA H200", None) == 989.0
    assert actor_bench.peak_tflops("NVIDIA H100 PCIe", None) is None
    assert actor_bench.peak_tflops("NVIDIA A10", 125.0) == 125.0


def test_grid_order_and_ratios_against_cublas():
    assert cells([(1, 2, 3), (4, 5, 6)], ["matmul", "fused"], ["torch"]) == [
        ("matmul", (1, 2, 3)), ("fused", (1, 2, 3)), ("matmul", (4, 5, 6)), ("fused", (4, 5, 6)),
        ("torch", (1, 2, 3)), ("torch", (4, 5, 6))]
    records = add_ratios([{"method": "matmul", "n": 1, "h": 2, "v": 3, "forward_tflops": 500.0},
                          {"method": "fused_linear", "n": 1, "h": 2, "v": 3, "forward_tflops": 300.0,
                           "backward_tflops": 250.0, "forward_ms": 2.0, "backward_ms": 5.0}])
    assert records[1]["forward_vs_cublas"] == 0.6 and records[1]["backward_vs_cublas"] == 0.5
    assert records[1]["fwd_bwd_ms"] == 7.0 and records[0]["backward_vs_cublas"] is None
