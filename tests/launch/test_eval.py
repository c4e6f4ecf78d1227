"""`megatron-cpo eval`: the pass@k estimator against its combinatorial definition, and a real run (tiny model, real
vLLM engine through Ray, real graders) whose report is recomputed from the per-sample file it writes."""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_cpo.cli import build_parser
from megatron_cpo.eval import pass_at_k, pass_ks, summarize_by_source

ROOT = Path(__file__).resolve().parents[2]


def test_pass_at_k_matches_the_combinatorial_formula():
    n = 8
    num_correct = np.arange(n + 1)
    for k in range(1, n + 1):
        expected = [1 - math.comb(n - c, k) / math.comb(n, k) for c in num_correct]
        assert np.allclose(pass_at_k(num_correct, n, k), expected)
    assert pass_at_k(np.array([1]), 4, 2)[0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="1 <= k <= n=4"):
        pass_at_k(num_correct, 4, 5)
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]


def test_summarize_by_source_groups_prompts():
    correct = np.array([[1, 0], [0, 0], [1, 1]], dtype=bool)
    scores = np.where(correct, 1.0, -1.0)
    report = summarize_by_source(["b", "a", "b"], correct, scores)
    assert list(report) == ["a", "b", "all"]
    assert report["a"] == {"num_prompts": 1.0, "mean@2": 0.0, "score@2": -1.0, "pass@1": 0.0, "pass@2": 0.0}
    assert report["b"]["mean@2"] == 0.75 and report["b"]["pass@2"] == 1.0 and report["b"]["pass@1"] == 0.75
    assert report["all"]["mean@2"] == pytest.approx(0.5) and report["all"]["pass@2"] == pytest.approx(2 / 3)


@pytest.mark.engine
def test_eval_command_on_tiny_model_with_real_vllm(tmp_path):
    from megatron_cpo.data.synthetic import ArithConfig, generate_arith, write_parquet
    from megatron_cpo.models.tiny import write_tiny_model
    from megatron_cpo.rewards import compute_score

    model = write_tiny_model(tmp_path / "tiny", family="qwen2", seed=0)
    rows = generate_arith(ArithConfig(num_train=4, num_test=4, seed=3))["test"]
    rows[1]["data_source"] = rows[3]["data_source"] = "math"
    data = write_parquet(rows, tmp_path / "test.parquet")
    out = tmp_path / "eval"
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("RAY_ADDRESS", None)
    done = subprocess.run([sys.executable, "-m", "megatron_cpo.cli", "eval", "--data", str(data), "--model",
                           str(model), "--n", "3", "--max-response-length", "12", "--max-prompt-length", "96",
                           "--dtype", "float32", "--output-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "megatron_cpo/arith" in done.stdout and "pass@3" in done.stdout
    # the default ray address without RAY_ADDRESS: a private cluster, never one found running on the machine
    assert "starting a private local Ray cluster (ray_address=auto and RAY_ADDRESS is not set" in done.stderr
    assert "eval [####################] 4/4 prompts" in done.stderr and "done" in done.stderr, done.stderr[-2000:]
    report = json.loads((out / "metrics.json").read_text())["metrics"]
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 * 3 and {s["data_source"] for s in samples} == {"math", "megatron_cpo/arith"}
    correct = np.zeros((4, 3), dtype=bool)
    for sample in samples:
        regraded = compute_score(sample["data_source"], sample["response"], sample["ground_truth"])
        assert regraded["acc"] == sample["acc"]
        correct[sample["index"], sample["sample"]] = sample["acc"]
    sources = [rows[i]["data_source"] for i in range(4)]
    scores = np.zeros((4, 3))
    for sample in samples:
        scores[sample["index"], sample["sample"]] = sample["score"]
    expected = summarize_by_source(sources, correct, scores)
    assert report.keys() == expected.keys()
    for source, metrics in expected.items():
        assert report[source] == pytest.approx(metrics), source
    assert report["math"]["num_prompts"] == 2 and report["all"]["num_prompts"] == 4
    bad = subprocess.run([sys.executable, "-m", "megatron_cpo.cli", "eval", "--data", str(data), "--model",
                          str(model), "--n", "2", "--temperature", "0"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "greedy" in bad.stderr


def test_lengths_beyond_the_models_positions_fail_before_any_engine_starts(tmp_path):
    """The tiny model has 1024 positions: the default 1024 + 1024 tokens cannot fit (vLLM would fail in engine
    start with a pydantic traceback); the error is one line naming both flags, and nothing (Ray, vLLM) starts."""
    from megatron_cpo.data.synthetic import ArithConfig, generate_arith, write_parquet

    data = write_parquet(generate_arith(ArithConfig(num_train=2, num_test=2, seed=3))["test"], tmp_path / "t.parquet")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-m", "megatron_cpo.cli", "eval", "--data", str(data), "--model",
                           str(ROOT / "examples" / "tiny" / "model"), "--max-response-length", "64"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert lines[-1].startswith("error: --max-prompt-length 1024 + --max-response-length 64 = 1088 tokens exceed "
                                "the 1024 positions of "), lines
    assert "Traceback" not in done.stderr and "Ray" not in done.stderr


@pytest.mark.parametrize("command", ["eval", "generate", "rollout"])
def test_every_flag_has_help(command):
    parser = build_parser()
    subparser = next(action for action in parser._subparsers._group_actions).choices[command]
    missing = [action.dest for action in subparser._actions if not action.help]
    assert not missing, f"flags of `megatron-cpo {command}` without help text: {missing}"
