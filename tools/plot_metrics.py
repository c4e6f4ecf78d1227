"""Learning curves from a run's metrics JSONL (the trainer's `jsonl` logger) as one PNG.

    python tools/plot_metrics.py outputs/run/metrics.jsonl --out curves.png
    python tools/plot_metrics.py grpo/metrics.jsonl cpo/metrics.jsonl --labels GRPO CPO --smooth 0.6 --out cmp.png

One panel per quantity in `PANELS` (reward, accuracy, filter rate, MI, entropy, response length, turns), each drawing
the metrics it lists that the run logged; panels with nothing logged are left out. Several files overlay as runs. A
resumed run appends to the same file, so a step logged twice keeps its last value. `--smooth` is an exponential moving
average weight (0: raw values); the raw curve stays visible behind the smoothed one. Sparse series (logged at fewer
than half the steps of the run's densest one, e.g. `val/acc` every `test_freq` steps) are never smoothed: an EMA over
five evaluations mixes the final accuracy with the first (0.70 drawn as 0.63).

Filter rate panel: `filter/filter_rate` and `filter/kept_ratio` need not sum to 1, because they count different
groups. `filter_rate` is dropped / committed prompts, the prompts consumed from the data stream up to the one that
filled the batch; `kept_ratio` is kept / judged groups, which also counts the groups that finished after the batch was
full (they go back to the data stream, but their filter outcome is still a sample of the keep rate, and it is what
`filter_loss_scaling` scales by). The legend says which denominator each uses.

Several seeds per algorithm (`--group`): files with the same label form one group, drawn as the mean across its runs
with a band (`--band minmax`, the default, or `std`: mean +- one sample standard deviation) over the steps every run
of the group logged; the default label of a file is then its grandparent folder (`<algo>/seed<k>/metrics.jsonl`):

    python tools/plot_metrics.py runs/*/seed*/metrics.jsonl --group --out curves.png

Needs matplotlib (`pip install -e '.[tools]'`, which `scripts/setup_env.sh` installs by default).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Panel:
    """One subplot: its title, the metrics it draws (in order) and the y-axis label."""

    title: str
    metrics: tuple[str, ...]
    ylabel: str = ""


PANELS: tuple[Panel, ...] = (
    Panel("Reward", ("reward/mean", "val/score"), "score"),
    Panel("Accuracy", ("reward/acc", "val/acc"), "fraction correct"),
    Panel("Filter rate", ("filter/filter_rate", "filter/kept_ratio", "frac_reward_zero_std"), "fraction of prompts"),
    Panel("Mutual information (CPO)", ("cpo/mi_mean", "cpo/mi_std", "cpo/mi_positive_ratio"), "MI"),
    Panel("Entropy", ("actor/entropy",), "nats / token"),
    Panel("Response length", ("completions/mean_length", "completions/max_length"), "tokens"),
    Panel("Turns (multi-turn episodes)", ("multi_turn/turns_mean", "val/multi_turn/turns_mean"), "turns / episode"),
)


# What the legend calls a metric whose name alone misleads.
LEGEND_NAMES = {"filter/filter_rate": "filter/filter_rate (dropped / committed prompts)",
                "filter/kept_ratio": "filter/kept_ratio (kept / all judged groups)"}

MATPLOTLIB_MISSING = ("matplotlib is not installed; install it with: pip install matplotlib  "
                      "(or the project's tools extra: pip install -e '.[tools]')")


def smoothing_for(run: dict[str, tuple[np.ndarray, np.ndarray]], metric: str, smoothing: float) -> float:
    """The EMA weight to draw `metric` with: `smoothing`, or 0 for a sparse series (logged at fewer than half the
    steps of the run's densest series: validation every test_freq steps, early-stop events)."""
    densest = max(len(steps) for steps, _ in run.values())
    return 0.0 if len(run[metric][0]) < 0.5 * densest else smoothing


def read_metrics(path: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """metric name -> (steps, values) from a JSONL file; non-numeric values are skipped, a re-logged step keeps its
    last value. A line that is not JSON is an error naming the file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"metrics file {str(path)!r} does not exist; the jsonl logger writes "
                                "<trainer.default_local_dir>/metrics.jsonl")
    by_step: dict[int, dict[str, float]] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path} line {number} is not JSON ({error.msg}); is this a metrics.jsonl file?") from None
        if not isinstance(record, dict) or "step" not in record:
            raise ValueError(f"{path} line {number} has no 'step'; expected {{\"step\": N, \"metric\": value, ...}}")
        values = by_step.setdefault(int(record["step"]), {})
        for key, value in record.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if key != "step" and numeric and math.isfinite(value):
                values[key] = float(value)
    series: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for key, value in by_step[step].items():
            steps, values = series.setdefault(key, ([], []))
            steps.append(step)
            values.append(value)
    return {key: (np.asarray(steps), np.asarray(values)) for key, (steps, values) in series.items()}


def smooth(values: np.ndarray, weight: float) -> np.ndarray:
    """Exponential moving average with TensorBoard's debiasing (early points are not pulled toward 0); weight 0
    returns the values unchanged."""
    if weight <= 0 or len(values) == 0:
        return values
    smoothed, running = np.empty(len(values)), 0.0
    for index, value in enumerate(values):
        running = weight * running + (1 - weight) * value
        smoothed[index] = running / (1 - weight ** (index + 1))
    return smoothed


def group_runs(runs: list[dict[str, tuple[np.ndarray, np.ndarray]]], labels: list[str]) \
        -> dict[str, list[dict[str, tuple[np.ndarray, np.ndarray]]]]:
    """Runs grouped by label, groups in the order their label first appears."""
    if len(runs) != len(labels):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs; give one label per run")
    groups: dict[str, list] = {}
    for run, label in zip(runs, labels):
        groups.setdefault(label, []).append(run)
    return groups


def band_across_runs(runs: list[dict[str, tuple[np.ndarray, np.ndarray]]], metric: str, band: str = "minmax") \
        -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(steps, mean, low, high) of `metric` over the steps every run that logged it has; `band` "minmax" gives the
    smallest and largest value at each step, "std" the mean -+ the sample standard deviation (0 for one run). None
    when no run logged it or the runs share no step."""
    if band not in ("minmax", "std"):
        raise ValueError(f"band={band!r}; choose 'minmax' or 'std'")
    series = [run[metric] for run in runs if metric in run]
    if not series:
        return None
    steps = series[0][0]
    for other_steps, _ in series[1:]:
        steps = np.intersect1d(steps, other_steps)
    if len(steps) == 0:
        return None
    values = np.stack([vals[np.searchsorted(st, steps)] for st, vals in series])
    mean = values.mean(axis=0)
    if band == "minmax":
        return steps, mean, values.min(axis=0), values.max(axis=0)
    std = values.std(axis=0, ddof=1) if len(series) > 1 else np.zeros_like(mean)
    return steps, mean, mean - std, mean + std


def _pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or the install line when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        raise ModuleNotFoundError(MATPLOTLIB_MISSING) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _panels_with_data(panels: tuple[Panel, ...], runs: list[dict]) -> list[Panel]:
    """The panels with at least one logged metric; a clear error naming what was logged when there is none."""
    shown = [panel for panel in panels if any(metric in run for run in runs for metric in panel.metrics)]
    if not shown:
        logged = sorted({key for run in runs for key in run})
        raise ValueError(f"none of the plotted metrics were logged; the files have: {', '.join(logged) or 'nothing'}")
    return shown


LINE_STYLES = ("-", "--", ":", "-.")


def _grid(plt: Any, count: int, max_columns: int, cell: tuple[float, float]) -> tuple[Any, Any]:
    """A figure with `count` axes in rows of at most `max_columns`, each `cell` (width, height) inches."""
    columns = min(max_columns, count)
    rows = math.ceil(count / columns)
    return plt.subplots(rows, columns, figsize=(cell[0] * columns, cell[1] * rows), squeeze=False)


def _label(axis: Any, panel: Panel) -> None:
    """The panel's title and y label, the step axis, a light grid and the legend."""
    axis.set_title(panel.title)
    axis.set_xlabel("step")
    axis.set_ylabel(panel.ylabel)
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)


def _save(plt: Any, figure: Any, axes: Any, shown: list[Panel], out: str | Path, title: str,
          title_size: float | None = None) -> None:
    """Hide the unused axes, title the figure and write it to `out` (folders made as needed)."""
    for axis in list(axes.flat)[len(shown):]:
        axis.set_visible(False)
    if title:
        figure.suptitle(title, fontsize=title_size)
    figure.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=110)
    plt.close(figure)


def plot_groups(groups: dict[str, list[dict[str, tuple[np.ndarray, np.ndarray]]]], out: str | Path,
                panels: tuple[Panel, ...] = PANELS, band: str = "minmax", smoothing: float = 0.0,
                title: str = "") -> list[str]:
    """One PNG at `out`: per panel and metric, each group's mean across its runs as a line and its band shaded.
    Dense series are smoothed (after averaging) like `plot`; sparse ones (val/acc) are drawn raw with markers."""
    plt = _pyplot()
    shown = _panels_with_data(panels, [run for runs in groups.values() for run in runs])
    figure, axes = _grid(plt, len(shown), 2, (6.4, 4.0))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, panel in zip(axes.flat, shown):
        for group_index, (label, runs) in enumerate(groups.items()):
            color = colors[group_index % len(colors)]
            for metric_index, metric in enumerate(m for m in panel.metrics if any(m in run for run in runs)):
                drawn = band_across_runs(runs, metric, band)
                if drawn is None:
                    continue
                steps, mean, low, high = drawn
                weight = min(smoothing_for(run, metric, smoothing) for run in runs if metric in run)
                name = label if len(panel.metrics) == 1 else f"{label}: {metric}"
                axis.fill_between(steps, smooth(low, weight), smooth(high, weight), color=color, alpha=0.18,
                                  linewidth=0)
                axis.plot(steps, smooth(mean, weight), color=color, label=name, linewidth=1.6,
                          linestyle=LINE_STYLES[metric_index % len(LINE_STYLES)],
                          marker="o" if len(steps) < 30 else None, markersize=3)
        _label(axis, panel)
    _save(plt, figure, axes, shown, out, title, title_size=10)
    return [panel.title for panel in shown]


def plot(runs: list[dict[str, tuple[np.ndarray, np.ndarray]]], labels: list[str], out: str | Path,
         smoothing: float = 0.0, panels: tuple[Panel, ...] = PANELS, title: str = "") -> list[str]:
    """Draw the panels that have data into one PNG at `out`; returns the titles of the panels drawn."""
    plt = _pyplot()
    shown = _panels_with_data(panels, runs)
    figure, axes = _grid(plt, len(shown), 3, (5.2, 3.6))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for axis, panel in zip(axes.flat, shown):
        for run_index, (run, label) in enumerate(zip(runs, labels)):
            for metric_index, metric in enumerate(m for m in panel.metrics if m in run):
                steps, values = run[metric]
                # one run: a color per metric; several runs: a color per run and a line style per metric
                color = colors[(metric_index if len(runs) == 1 else run_index) % len(colors)]
                shown_name = LEGEND_NAMES.get(metric, metric)
                name = shown_name if len(runs) == 1 else f"{label}: {shown_name}"
                weight = smoothing_for(run, metric, smoothing)
                if weight > 0:
                    axis.plot(steps, values, color=color, alpha=0.25, linewidth=1)
                marker = "o" if len(steps) < 30 else None
                linestyle = "-" if len(runs) == 1 else LINE_STYLES[metric_index % len(LINE_STYLES)]
                axis.plot(steps, smooth(values, weight), color=color, label=name, marker=marker, markersize=3,
                          linestyle=linestyle, linewidth=1.6)
        _label(axis, panel)
    _save(plt, figure, axes, shown, out, title)
    return [panel.title for panel in shown]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("files", nargs="+", help="metrics.jsonl of one or more runs")
    parser.add_argument("--out", default="metrics.png", help="PNG to write")
    parser.add_argument("--labels", nargs="*", default=None, help="one label per file (default: parent folder)")
    parser.add_argument("--smooth", type=float, default=0.0, help="EMA weight in [0, 1), e.g. 0.6; sparse series "
                        "such as val/acc are drawn raw")
    parser.add_argument("--title", default="", help="figure title")
    parser.add_argument("--group", action="store_true", help="files with the same label are one group (e.g. the "
                        "seeds of one algorithm): mean line and a band across them")
    parser.add_argument("--band", default="minmax", choices=("minmax", "std"),
                        help="with --group: min-max across runs, or mean +- one standard deviation")
    args = parser.parse_args(argv)
    default_label = (lambda path: Path(path).parent.parent.name) if args.group else \
        (lambda path: Path(path).parent.name or Path(path).stem)
    labels = args.labels or [default_label(path) for path in args.files]
    try:
        if len(labels) != len(args.files):
            raise ValueError(f"--labels gave {len(labels)} labels for {len(args.files)} files; give one per file")
        if not 0 <= args.smooth < 1:
            raise ValueError(f"--smooth={args.smooth} must be in [0, 1)")
        runs = [read_metrics(path) for path in args.files]
        if args.group:
            drawn = plot_groups(group_runs(runs, labels), args.out, band=args.band, smoothing=args.smooth,
                                title=args.title)
        else:
            drawn = plot(runs, labels, args.out, args.smooth, title=args.title)
    except (FileNotFoundError, ValueError, ModuleNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out} with panels: {', '.join(drawn)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
