"""The report of `compare_lora.py`: does LoRA match full fine-tuning, at what memory and cost per step?

    python benchmarks/real_model/compare_lora_report.py              # runs/compare_lora
    python benchmarks/real_model/compare_lora_report.py --runs DIR   # another comparison directory (a smoke run)

Reads the finished runs under `<runs>/<arm>/seed<k>/` (a run still going or stopped is listed and left out). Prints
held-out accuracy (greedy, the same questions) at every validation along the sample budget, each arm's mean over seeds;
the paired difference of each LoRA arm from full fine-tuning at the budget's end with its 95% t interval
(`benchmarks/learning/stats.py`), against the goal (at most 2 points behind); and per arm the trainer process's peak
resident memory (the largest `trainer_peak_rss_gib` of `step_cpu.jsonl`) as a share of full fine-tuning's (the goal: at
most 60%), the actor update's and the weight push's seconds per step (`timing/update_actor_s`, `timing/weight_sync_s`,
medians over the runs' steps).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "learning"))
sys.path.insert(0, str(HERE))

from compare_cpo import read_rows  # noqa: E402
from compare_lora import LORA  # noqa: E402
from stats import paired_difference, summarize  # noqa: E402

FULL = "grpo"


def finished_runs(runs: Path) -> dict[str, dict[int, Path]]:
    """{arm: {seed: run directory}} of the runs whose run.json says finished."""
    found: dict[str, dict[int, Path]] = {}
    for arm in LORA.arms:
        for path in sorted((runs / arm).glob("seed*")):
            record = json.loads((path / "run.json").read_text()) if (path / "run.json").is_file() else {}
            if record.get("finished"):
                found.setdefault(arm, {})[int(path.name.removeprefix("seed"))] = path
            else:
                print(f"{arm}/{path.name}: not finished, left out")
    return found


def validations(path: Path) -> dict[float, float]:
    """Generated samples -> held-out accuracy (%) at every validation of a run (0 before training)."""
    return {(row.get("train/generated_samples", 0.0) if step else 0.0): 100 * row["val/acc"]
            for step, row in read_rows(path / "metrics.jsonl").items() if "val/acc" in row}


def peak_gib(path: Path) -> float | None:
    """The trainer's peak resident memory over a run; None for a run made before the runner recorded it."""
    rows = [json.loads(line) for line in (path / "step_cpu.jsonl").read_text().splitlines() if line.strip()]
    return max((row["trainer_peak_rss_gib"] for row in rows if row.get("trainer_peak_rss_gib") is not None),
               default=None)


def mean_peak_gib(paths: list[Path]) -> float | None:
    """The mean over the runs that recorded their peak (None if none did)."""
    peaks = [peak for peak in map(peak_gib, paths) if peak is not None]
    return summarize(peaks).mean if peaks else None


def median_metric(paths: list[Path], key: str) -> float:
    return statistics.median(row[key] for path in paths for step, row in read_rows(path / "metrics.jsonl").items()
                             if step > 0 and key in row)


def report(runs: Path) -> str:
    found = finished_runs(runs)
    arms = [arm for arm in LORA.arms if arm in found]
    if FULL not in found:
        return f"no finished run of {FULL} under {runs}"
    curves = {arm: {seed: validations(path) for seed, path in found[arm].items()} for arm in arms}
    budget = sorted(set.intersection(*(set(curve) for runs_ in curves.values() for curve in runs_.values())))
    lines = ["| arm | " + " | ".join(f"{int(x):,}" for x in budget) + " |",
             "| --- |" + " --- |" * len(budget)]
    for arm in arms:
        means = [summarize([curves[arm][seed][x] for seed in curves[arm]]).mean for x in budget]
        lines.append(f"| {arm} ({len(curves[arm])} seeds) | " + " | ".join(f"{m:.1f}" for m in means) + " |")
    end = budget[-1]
    lines += ["", f"At {int(end):,} samples, difference from full fine-tuning (points, 95% t interval):"]
    full_peak = mean_peak_gib(list(found[FULL].values()))
    for arm in arms:
        if arm != FULL:
            difference, seeds = paired_difference({s: c[end] for s, c in curves[arm].items()},
                                                  {s: c[end] for s, c in curves[FULL].items()})
            lines.append(f"- {arm} - {FULL}: {difference.mean:+.1f} [{difference.low:+.1f}, {difference.high:+.1f}] "
                         f"over seeds {seeds}; at most 2 points behind: {difference.mean >= -2}")
    lines += ["", "| arm | trainer peak RSS (GiB) | share of full | update s/step | push s/step |",
              "| --- | --- | --- | --- | --- |"]
    for arm in arms:
        paths = list(found[arm].values())
        peak = mean_peak_gib(paths)
        share = f"{100 * peak / full_peak:.0f}%" if peak is not None and full_peak is not None else "-"
        lines.append(f"| {arm} | {'not recorded' if peak is None else f'{peak:.2f}'} | {share} | "
                     f"{median_metric(paths, 'timing/update_actor_s'):.1f} | "
                     f"{median_metric(paths, 'timing/weight_sync_s'):.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--runs", type=Path, default=LORA.runs)
    print(report(parser.parse_args(argv).runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
