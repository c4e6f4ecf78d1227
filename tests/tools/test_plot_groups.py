"""tools/plot_metrics.py --group: runs grouped by label, mean and band across them (hand-computed values)."""
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from plot_metrics import band_across_runs, group_runs, main  # noqa: E402


def run(steps, values, metric="val/acc"):
    return {metric: (np.asarray(steps), np.asarray(values, dtype=float))}


def test_group_runs_keeps_first_appearance_order_and_checks_counts():
    a1, b1, a2 = run([0], [0.1]), run([0], [0.2]), run([0], [0.3])
    groups = group_runs([a1, b1, a2], ["A", "B", "A"])
    assert list(groups) == ["A", "B"] and groups["A"] == [a1, a2] and groups["B"] == [b1]
    with pytest.raises(ValueError, match="2 labels for 3 runs"):
        group_runs([a1, b1, a2], ["A", "B"])


def test_band_uses_common_steps_minmax_and_std():
    runs = [run([0, 10, 20], [0.1, 0.5, 0.7]), run([0, 20], [0.3, 0.9])]
    steps, mean, low, high = band_across_runs(runs, "val/acc", "minmax")
    assert list(steps) == [0, 20]  # step 10 is not in every run
    assert mean == pytest.approx([0.2, 0.8]) and low == pytest.approx([0.1, 0.7]) and high == pytest.approx([0.3, 0.9])
    # two values 0.1, 0.3: sample std = |0.3 - 0.1| / sqrt(2) = 0.141421
    _, mean, low, high = band_across_runs(runs, "val/acc", "std")
    assert high - mean == pytest.approx([0.141421, 0.141421], abs=1e-6) and mean - low == pytest.approx(high - mean)
    assert band_across_runs(runs, "reward/acc") is None
    with pytest.raises(ValueError, match="band='iqr'"):
        band_across_runs(runs, "val/acc", "iqr")


def test_group_cli_labels_by_grandparent_folder_and_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="plotting needs the tools extra (scripts/setup_env.sh installs it)")
    files = []
    for algo, seed, final in (("grpo", 1, 0.5), ("grpo", 2, 0.6), ("cpo", 1, 0.7)):
        path = tmp_path / algo / f"seed{seed}" / "metrics.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text(f'{{"step": 0, "val/acc": 0.3}}\n{{"step": 1, "reward/acc": 0.4}}\n'
                        f'{{"step": 2, "val/acc": {final}, "reward/acc": 0.6}}\n')
        files.append(str(path))
    out = tmp_path / "curves.png"
    assert main([*files, "--group", "--band", "std", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Accuracy" in capsys.readouterr().out
