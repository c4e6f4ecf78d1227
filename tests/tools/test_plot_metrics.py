"""tools/plot_metrics.py: reading the trainer's metrics JSONL and rendering learning curves to PNG."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from plot_metrics import main, read_metrics, smooth, smoothing_for  # noqa: E402

from megatron_cpo.trainer.driver.loggers import JsonlSink  # noqa: E402


def write_run(path: Path, steps: int = 12, resumed_at: int = 8) -> None:
    """A metrics file written by the trainer's own JSONL sink, including a resume that re-logs one step."""
    sink = JsonlSink(path)
    for step in range(1, steps + 1):
        sink.log({"reward/mean": -1 + step / steps, "reward/acc": step / (2 * steps), "val/acc": step / (3 * steps),
                  "filter/filter_rate": 0.5 - step / (4 * steps), "cpo/mi_std": 0.1 * step, "actor/entropy": 1.0 / step,
                  "completions/mean_length": 10.0 + step, "actor/kl": float("nan")}, step)
        if step == resumed_at:
            sink.log({"reward/mean": 5.0}, step)
    sink.close()


def test_read_metrics_keeps_last_value_of_a_relogged_step_and_skips_non_numbers(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    write_run(path)
    series = read_metrics(path)
    steps, values = series["reward/mean"]
    assert list(steps) == list(range(1, 13)) and values[7] == 5.0
    assert "actor/kl" not in series, "NaN is written as a string and must not be plotted"


def test_smooth_matches_hand_computed_debiased_ema():
    values = np.array([1.0, 3.0, 2.0])
    expected = [1.0, (0.5 * 0.5 * 1 + 0.5 * 3) / 0.75, (0.5 * (0.25 + 1.5) + 0.5 * 2) / 0.875]
    assert np.allclose(smooth(values, 0.5), expected)
    assert smooth(values, 0.0) is values


def test_renders_a_png_with_one_panel_per_logged_quantity(tmp_path, capsys):
    first, second = tmp_path / "grpo" / "metrics.jsonl", tmp_path / "cpo" / "metrics.jsonl"
    write_run(first)
    write_run(second, steps=20)
    out = tmp_path / "curves.png"
    assert main([str(first), str(second), "--out", str(out), "--smooth", "0.5", "--title", "test"]) == 0
    printed = capsys.readouterr().out
    for title in ("Reward", "Accuracy", "Filter rate", "Mutual information (CPO)", "Entropy", "Response length"):
        assert title in printed
    import matplotlib.image

    image = matplotlib.image.imread(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and image.shape[0] > 400 and image.shape[1] > 1000
    assert image[..., :3].std() > 0.05, "the image is blank"


def test_clear_errors(tmp_path):
    assert main([str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "x.png")]) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\nnot json\n")
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_metrics(bad)
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"step": 1, "something/else": 1.0}) + "\n")
    assert main([str(other), "--out", str(tmp_path / "y.png")]) == 2
    assert not (tmp_path / "y.png").exists()


def test_renders_a_real_trainer_run(tmp_path, capsys):
    """fixtures/tiny_grpo_run_metrics.jsonl was written by the trainer's JSONL sink during a real 2-step CPU run of
    the tiny model (GRPO, vLLM rollouts); validation and training metrics of step 2 share a step."""
    run = Path(__file__).parent / "fixtures" / "tiny_grpo_run_metrics.jsonl"
    series = read_metrics(run)
    assert list(series["val/acc"][0]) == [0, 2] and list(series["reward/mean"][0]) == [1, 2]
    out = tmp_path / "real.png"
    assert main([str(run), "--out", str(out)]) == 0
    assert "Reward, Accuracy, Filter rate, Entropy, Response length" in capsys.readouterr().out
    assert out.stat().st_size > 10_000


def test_sparse_series_are_drawn_raw(tmp_path):
    """val/acc logged every 10 of 40 steps (and at 0): an EMA would mix the last evaluation with the first."""
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": step, "reward/mean": step / 40} for step in range(1, 41)]
    rows += [{"step": step, "val/acc": acc} for step, acc in zip((0, 10, 20, 30, 40), (0.5, 0.55, 0.6, 0.65, 0.7))]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = read_metrics(path)
    assert smoothing_for(run, "val/acc", 0.6) == 0.0
    assert smoothing_for(run, "reward/mean", 0.6) == 0.6
    assert main([str(path), "--out", str(tmp_path / "c.png"), "--smooth", "0.6"]) == 0


def test_missing_matplotlib_names_the_install_line(tmp_path):
    """matplotlib made unimportable in a fresh interpreter (sys.modules entry None), the tool run as a script."""
    run = Path(__file__).parent / "fixtures" / "tiny_grpo_run_metrics.jsonl"
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; "
            f"sys.argv = ['plot_metrics.py', {str(run)!r}, '--out', {str(tmp_path / 'x.png')!r}]; "
            f"runpy.run_path({str(ROOT / 'tools' / 'plot_metrics.py')!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(ROOT)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("error: matplotlib is not installed; install it with: pip install matplotlib  "
                                   "(or the project's tools extra: pip install -e '.[tools]')")
    assert not (tmp_path / "x.png").exists()
