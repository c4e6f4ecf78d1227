"""The report of `compare_lora.py`: does LoRA match full fine-tuning, at what memory and cost per step?

    python benchmarks/real_model/compare_lora_report.py              # runs/compare_lora
    python benchmarks/real_model/compare_lora_report.py --runs runs/compare_lora640 \
        benchmarks/real_model/results/compare_lora640                # these runs, then the committed records

Reads the finished runs under `<runs>/<arm>/seed<k>/` of each directory given, the first one's where a seed is in
several (a run still going or stopped is listed and left out; `results/` holds every finished run's record). Prints
held-out accuracy (greedy, the same questions) at every validation along the sample budget, each arm's mean over seeds;
the paired difference of each LoRA arm from full fine-tuning at the budget's end with its 95% t interval
(`benchmarks/learning/stats.py`), against the goal (at most 2 points behind); and per arm the trainer process's peak
resident memory (the largest `trainer_peak_rss_gib` of `step_cpu.jsonl`) as a share of full fine-tuning's (the goal: at
most 60%), the actor update's and the weight push's seconds per step (`timing/update_actor_s`, `timing/weight_sync_s`,
medians over the runs' steps).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "learning"))
sys.path.insert(0, str(HERE))

from compare_cpo_report import RunData, load_finished  # noqa: E402
from compare_lora import LORA  # noqa: E402
from stats import paired_difference, summarize  # noqa: E402

FULL = "grpo"


def validations(run: RunData) -> dict[float, float]:
    """Generated samples -> held-out accuracy (%) at every validation of a run (0 before training)."""
    return {(row.get("train/generated_samples", 0.0) if step else 0.0): 100 * row["val/acc"]
            for step, row in run.rows.items() if "val/acc" in row}


def mean_peak_gib(runs: list[RunData]) -> float | None:
    """The mean over the runs that recorded their peak (None if none did)."""
    peaks = [run.peak_gib for run in runs if run.peak_gib is not None]
    return summarize(peaks).mean if peaks else None


def median_metric(runs: list[RunData], key: str) -> float:
    return statistics.median(row[key] for run in runs for step, row in run.rows.items() if step > 0 and key in row)


def report(directories: list[Path]) -> str:
    found: dict[str, dict[int, RunData]] = {}
    for run in load_finished(directories, LORA.arms):
        found.setdefault(run.arm, {})[run.seed] = run
    arms = [arm for arm in LORA.arms if arm in found]
    if FULL not in found:
        return f"no finished run of {FULL} under {', '.join(map(str, directories))}"
    curves = {arm: {seed: validations(run) for seed, run in found[arm].items()} for arm in arms}
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
            if not set(curves[arm]) & set(curves[FULL]):
                lines.append(f"- {arm} - {FULL}: no seed in common ({arm}: {sorted(curves[arm])}, {FULL}: "
                             f"{sorted(curves[FULL])})")
                continue
            difference, seeds = paired_difference({s: c[end] for s, c in curves[arm].items()},
                                                  {s: c[end] for s, c in curves[FULL].items()})
            interval = f"[{difference.low:+.1f}, {difference.high:+.1f}]" if difference.n > 1 else "(no interval)"
            lines.append(f"- {arm} - {FULL}: {difference.mean:+.1f} {interval} over seeds {seeds}; at most 2 points "
                         f"behind: {difference.mean >= -2}")
    lines += ["", "| arm | trainer peak RSS (GiB) | share of full | update s/step | push s/step |",
              "| --- | --- | --- | --- | --- |"]
    for arm in arms:
        runs = list(found[arm].values())
        peak = mean_peak_gib(runs)
        share = f"{100 * peak / full_peak:.0f}%" if peak is not None and full_peak is not None else "-"
        lines.append(f"| {arm} | {'not recorded' if peak is None else f'{peak:.2f}'} | {share} | "
                     f"{median_metric(runs, 'timing/update_actor_s'):.1f} | "
                     f"{median_metric(runs, 'timing/weight_sync_s'):.2f} |")
    lines += ["", "Timings from: " + "; ".join(f"{run.arm}/seed{run.seed} {run.machine}" for arm in arms
                                          for run in found[arm].values())]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--runs", type=Path, nargs="+", default=[LORA.runs],
                        help="comparison directories, in order of precedence for a seed found in several (e.g. "
                             "runs/compare_lora640 benchmarks/real_model/results/compare_lora640)")
    print(report(parser.parse_args(argv).runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
