"""The report of the on-policy distillation arms of `compare_cpo.py`: accuracy along the sample budget and against CPU
seconds, and the samples each arm needs to reach 90% of the teacher's accuracy (issue 47's measure).

    python benchmarks/real_model/compare_opd_report.py                           # runs/compare_cpo
    python benchmarks/real_model/compare_opd_report.py --runs runs/compare_opd640 --also runs/compare_cpo
    R=benchmarks/real_model/results                                               # the committed records
    python benchmarks/real_model/compare_opd_report.py --runs $R/compare_cpo640 --also $R/compare_cpo2560 \
        $R/compare_lora640 --teacher-run $R/compare_cpo2560/grpo/seed1

Reads the finished runs of the arms `grpo`, `cpo_grpo`, `opd`, `opd_task`, `opsd`, `opsd_task` and
`opsd_task_c0.1_t0.7` under `--runs` and then under each `--also` directory for the arm/seed pairs not found yet (GRPO's
seed 1 is the teacher's own run, made once in runs/compare_cpo at 2,560 samples). The teacher's accuracy is the last
validation of `--teacher-run` (the run whose final policy is the teacher, default runs/compare_cpo/grpo/seed1). The
samples to a threshold are interpolated linearly between the two validations around the first crossing; a run that
never crosses says "> its last count". Each arm minus GRPO is paired by seed at the counts every run validated at.
Accuracy at equal CPU seconds is interpolated at the fewest CPU seconds (process tree, compare_cpo_report.step_cpu)
every finished run reached.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "benchmarks" / "learning"))
sys.path.insert(0, str(HERE))

from compare_cpo import RUNS, TEACHER, read_rows  # noqa: E402
from compare_cpo_report import RunData, load_finished, paired_runs  # noqa: E402
from stats import paired_difference, summarize  # noqa: E402

ARMS = ("grpo", "cpo_grpo", "opd", "opd_task", "opsd", "opsd_task", "opsd_task_c0.1_t0.7")
SHARE = 0.9  # of the teacher's accuracy: the "reaches the teacher"


def crossing(points: list[tuple[float, float]], threshold: float) -> float | None:
    """The x at which a curve of (x, accuracy) first reaches `threshold`, linear between points; None if never."""
    for (x0, y0), (x1, y1) in zip([points[0], *points], points):
        if y1 >= threshold:
            return x1 if y1 == y0 or x1 == x0 else x0 + (x1 - x0) * (threshold - y0) / (y1 - y0)
    return None


def teacher_accuracy(run: Path) -> float:
    rows = read_rows(run / "metrics.jsonl")
    return 100 * [row["val/acc"] for row in rows.values() if "val/acc" in row][-1]


def report(runs: list[RunData], teacher: float) -> str:
    arms = [arm for arm in ARMS if any(r.arm == arm for r in runs)]
    grid = sorted(set.intersection(*(set(x for x, _ in r.points("samples")) for r in runs)))
    lines = ["Held-out accuracy (%, greedy; mean over seeds) at the sample counts every run validated at:", "",
             "| arm | seeds | " + " | ".join(f"{x:,.0f}" for x in grid) + " |", "| --- | --- |" + " --- |" * len(grid)]
    for arm in arms:
        mine = [r for r in runs if r.arm == arm]
        cells = [f"{statistics.mean(dict(r.points('samples'))[x] for r in mine):.1f}" for x in grid]
        lines.append(f"| {arm} | {','.join(str(r.seed) for r in mine)} | " + " | ".join(cells) + " |")
    threshold = SHARE * teacher
    seeds = sorted({r.seed for r in runs})
    lines += ["", f"Samples to {SHARE:.0%} of the teacher's {teacher:.1f}% ({threshold:.1f}%), by seed; the ratio "
              "to GRPO's same seed:", "", "| arm | " + " | ".join(f"seed {s}" for s in seeds) + " |",
              "| --- |" + " --- |" * len(seeds)]
    by_key = {(r.arm, r.seed): r for r in runs}
    reached = {key: crossing(r.points("samples"), threshold) for key, r in by_key.items()}
    for arm in arms:
        cells = []
        for seed in seeds:
            run, at, grpo = by_key.get((arm, seed)), reached.get((arm, seed)), by_key.get(("grpo", seed))
            cells.append("-" if run is None else f"{at:,.0f}" if at is not None else f"> {run.last('samples'):,.0f}")
            if arm != "grpo" and at is not None and grpo is not None:
                base = reached["grpo", seed]
                # GRPO never crossed: it needs more than its last count, so the ratio is below at / that count
                cells[-1] += f" ({at / base:.2f}x)" if base else f" (< {at / grpo.last('samples'):.2f}x)"
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Each arm minus GRPO, paired by seed (points; 95% t interval over the seeds both finished):", "",
              "| arm | seeds | " + " | ".join(f"{x:,.0f}" for x in grid[1:]) + " |",
              "| --- | --- |" + " --- |" * len(grid[1:])]
    for arm in [arm for arm in arms if arm != "grpo"] if "grpo" in arms else []:
        mine, grpo, seeds = paired_runs(runs, arm, "grpo")
        if not seeds:
            lines.append(f"| {arm} | no seed in common with GRPO |" + " |" * len(grid[1:]))
            continue
        cells = []
        for x in grid[1:]:
            diff, _ = paired_difference({s: mine[s].at("samples", x) for s in seeds},
                                        {s: grpo[s].at("samples", x) for s in seeds})
            cells.append(f"{diff.mean:+.1f}" + (f" [{diff.low:+.1f}, {diff.high:+.1f}]" if diff.n >= 2 else ""))
        lines.append(f"| {arm} | {','.join(map(str, seeds))} | " + " | ".join(cells) + " |")
    common = min(r.last("cpu") for r in runs)
    lines += ["", f"At equal CPU seconds of the process tree ({common:,.0f} s, the fewest any run reached): accuracy "
              "(%), and CPU seconds per step (mean over seeds):", "", "| arm | accuracy | CPU s / step |",
              "| --- | --- | --- |"]
    for arm in arms:
        mine = [r for r in runs if r.arm == arm]
        accuracy = summarize([r.at("cpu", common) for r in mine]).mean
        per_step = statistics.mean(r.last("cpu") / r.last("steps") for r in mine)
        lines.append(f"| {arm} | {accuracy:.1f} | {per_step:,.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--runs", type=Path, default=RUNS)
    parser.add_argument("--also", type=Path, nargs="*", default=[], help="more comparison directories to read")
    parser.add_argument("--teacher-run", type=Path, default=TEACHER.parent,
                        help="the run whose final policy is the teacher (its last validation is the teacher's)")
    args = parser.parse_args(argv)
    runs = load_finished([args.runs, *args.also], ARMS)
    if not runs:
        print(f"no finished run of {', '.join(ARMS)} under {args.runs}")
        return 1
    print(report(runs, teacher_accuracy(args.teacher_run)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
