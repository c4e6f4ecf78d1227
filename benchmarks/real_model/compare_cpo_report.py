"""The report of `compare_cpo.py`: curves, the final table with paired differences, and the docs that quote them.

    python benchmarks/real_model/compare_cpo_report.py            # print the report, write the three PNGs
    python benchmarks/real_model/compare_cpo_report.py --write    # also regenerate the docs' generated blocks

Reads whatever runs of the CPO comparison's arms (`CPO_ARMS`; the distillation arms have compare_opd_report.py) have
finished under `runs/compare_cpo/<arm>/seed<k>/` (a run still going, or stopped, is listed as such and left out of the
numbers). Held-out accuracy is greedy, on the same 200 questions. Curves against generated samples, update steps and CPU
seconds of the run's whole process tree (`step_cpu.jsonl`; the start-up and the validation before training left out, the
validations during training kept: every arm makes the same number), one PNG per axis. The final table: each arm's mean
over seeds with one standard error; paired differences by seed with 95% t intervals (`benchmarks/learning/stats.py`) at
the equal sample budget (the last validation), at an equal number of steps and at equal CPU seconds (accuracy
interpolated linearly between validations, at the fewest steps / CPU seconds either arm's runs reached). Then what the
step cost (generation batches, the actor's passes) and the MI signal: the share of responses scored under a hint and of
tokens shaped, the MI's quantiles on right and wrong responses (`cpo/*`), beside the start model's on the captured batch
with every response scored under its hint (`cpo_step_results.jsonl`) and the tiny model's learning-table runs.

`--write` replaces the blocks between the `<!-- compare_cpo:... -->` markers of docs/cpo.md ("When CPO pays") and
docs/status.md (the SmolLM2 rows of its learning section).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "benchmarks" / "learning"))
sys.path.insert(0, str(HERE))

from compare_cpo import BUDGET, CPO_ARMS, RUNS, VAL_EVERY, read_rows  # noqa: E402
from machine import describe_machine  # noqa: E402
from stats import Summary, paired_difference, summarize, verdict  # noqa: E402

NAMES = {"grpo": "GRPO", "dapo": "DAPO", "cpo": "CPO on DAPO (cpo.yaml)", "cpo_grpo": "CPO on GRPO (cpo_grpo.yaml)"}
PAIRS = [("dapo", "grpo"), ("cpo", "dapo"), ("cpo", "grpo"), ("cpo_grpo", "grpo")]
AXES = {"samples": "generated samples", "steps": "update steps", "cpu": "CPU seconds of the process tree"}
TIMINGS = ("filter/num_gen_batches", "timing/gen_s", "timing/old_log_prob_s", "timing/hint_log_prob_s",
           "timing/update_actor_s", "timing/weight_sync_s", "timing/sync_check_s", "timing/step_s")
MI_KEYS = ("cpo/hinted_frac", "cpo/shaped_token_frac", "cpo/mi_wrong_p10", "cpo/mi_wrong_p50", "cpo/mi_wrong_p90",
           "cpo/mi_correct_p10", "cpo/mi_correct_p50", "cpo/mi_correct_p90", "cpo/mi_positive_ratio")
BENCH = HERE / "cpo_step_results.jsonl"
TINY = REPO / "benchmarks" / "learning" / "runs" / "arith12" / "cpo"
DOCS = {REPO / "docs" / "cpo.md": "when", REPO / "docs" / "status.md": "rows"}


@dataclass
class RunData:
    arm: str
    seed: int
    finished: bool
    rows: dict[int, dict]
    cpu: dict[int, float] = field(default_factory=dict)  # step -> cumulative CPU seconds after it
    peak_gib: float | None = None  # the trainer's peak resident memory (None: a run made before the runner kept it)
    machine: str = "not recorded"  # the CPU of its last attempt (machine.describe_machine), for its timings

    def points(self, axis: str) -> list[tuple[float, float]]:
        """(x, held-out accuracy in %) at every validation, x on `axis`."""
        out = []
        for step, row in self.rows.items():
            if "val/acc" in row and (step == 0 or step in self.cpu):
                x = {"steps": step, "samples": row.get("train/generated_samples", 0.0) if step else 0.0,
                     "cpu": self.cpu.get(step, 0.0)}[axis]
                out.append((float(x), 100 * row["val/acc"]))
        return out

    def at(self, axis: str, x: float) -> float:
        """Accuracy interpolated linearly between validations at `x` (within the run's range)."""
        points = self.points(axis)
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x0 <= x <= x1:
                return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        raise ValueError(f"{self.arm}/seed{self.seed}: {axis}={x} outside {points[0][0]}..{points[-1][0]}")

    def last(self, axis: str) -> float:
        return self.points(axis)[-1][0]

    def mean_of(self, key: str) -> float | None:
        values = [row[key] for step, row in self.rows.items() if step > 0 and key in row]
        return statistics.mean(values) if values else None


def read_step_cpu(path: Path) -> list[dict]:
    """The entries of a run's `step_cpu.jsonl` ([] without the file)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def step_cpu(path: Path) -> dict[int, float]:
    """`cpu_by_step` of a run's `step_cpu.jsonl`."""
    return cpu_by_step(read_step_cpu(path))


def cpu_by_step(entries: list[dict]) -> dict[int, float]:
    """Cumulative CPU seconds after each step: each step's own (its tree CPU minus the previous row's in the same
    attempt, a resumed attempt's "resumed" row included, so its start-up is not counted; the last attempt's when a
    resume redid the step), summed from step 1 up to the first step without a row (the sum past a gap would be too
    low)."""
    own: dict[int, float] = {}
    previous: dict[int, float] = {}
    for entry in entries:
        if "step" in entry:
            own[entry["step"]] = entry["tree_cpu_s"] - previous.get(entry["attempt"], 0.0)
        previous[entry["attempt"]] = entry["tree_cpu_s"]
    total, cumulative, step = 0.0, {}, 1
    while step in own:
        total += own[step]
        cumulative[step] = total
        step += 1
    return cumulative


def peak_gib(entries: list[dict]) -> float | None:
    """The largest `trainer_peak_rss_gib` of a run's `step_cpu.jsonl` entries (None where no entry has it)."""
    return max((entry["trainer_peak_rss_gib"] for entry in entries if entry.get("trainer_peak_rss_gib") is not None),
               default=None)


def load_runs(runs_dir: Path = RUNS, arms=CPO_ARMS) -> list[RunData]:
    """Every run of `arms` under `runs_dir`, finished or not (its run.json says which)."""
    runs = []
    for arm in arms:
        for directory in sorted((runs_dir / arm).glob("seed*")):
            record_path = directory / "run.json"
            record = json.loads(record_path.read_text()) if record_path.is_file() else {}
            entries = read_step_cpu(directory / "step_cpu.jsonl")
            runs.append(RunData(arm, int(directory.name[4:]), bool(record.get("finished")),
                                read_rows(directory / "metrics.jsonl"), cpu_by_step(entries),
                                peak_gib(entries), describe_machine(record)))
    return runs


def load_finished(directories: list[Path], arms) -> list[RunData]:
    """The finished runs of `arms` in arm then seed order; an arm/seed found in an earlier directory wins (a live runs
    directory before the committed results). Unfinished runs not found finished elsewhere are named."""
    found: dict[tuple[str, int], RunData] = {}
    unfinished = []
    for directory in directories:
        for run in load_runs(directory, arms):
            if run.finished:
                found.setdefault((run.arm, run.seed), run)
            else:
                unfinished.append((run.arm, run.seed, directory))
    for arm, seed, directory in unfinished:
        if (arm, seed) not in found:
            print(f"{directory / arm / f'seed{seed}'}: not finished, left out")
    return [found[key] for key in sorted(found, key=lambda key: (list(arms).index(key[0]), key[1]))]


def _cell(summary: Summary | None, digits: int = 1, unit: str = "") -> str:
    if summary is None:
        return "-"
    if summary.n < 2:
        return f"{summary.mean:.{digits}f}{unit} (1 seed)"
    return f"{summary.mean:.{digits}f}{unit} ± {summary.std / math.sqrt(summary.n):.{digits}f}"


def final_table(done: list[RunData]) -> list[str]:
    lines = ["| arm | seeds | start | at the budget's end | change | steps | CPU s (tree) | CPU s / step |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for arm in CPO_ARMS:
        runs = [r for r in done if r.arm == arm]
        if not runs:
            lines.append(f"| {NAMES[arm]} | 0 | - | - | - | - | - | - |")
            continue
        start = summarize([r.points("steps")[0][1] for r in runs])
        end = summarize([r.points("steps")[-1][1] for r in runs])
        change = summarize([r.points("steps")[-1][1] - r.points("steps")[0][1] for r in runs])
        steps = summarize([r.last("steps") for r in runs])
        cpu = summarize([r.last("cpu") for r in runs])
        per_step = summarize([r.last("cpu") / r.last("steps") for r in runs])
        lines.append(f"| {NAMES[arm]} | {len(runs)} | {_cell(start, unit='%')} | {_cell(end, unit='%')} | "
                     f"{_cell(change)} | {_cell(steps, 0)} | {_cell(cpu, 0)} | {_cell(per_step, 0)} |")
    return lines


def paired_table(done: list[RunData]) -> list[str]:
    lines = ["| comparison | at the budget's end | at equal steps | at equal CPU seconds | reading (samples) |",
             "| --- | --- | --- | --- | --- |"]
    for arm, other in PAIRS:
        a, b, seeds = paired_runs(done, arm, other)
        if not seeds:
            lines.append(f"| {NAMES[arm]} - {NAMES[other]} | no seed finished in both | | | |")
            continue
        cells = []
        for axis in ("samples", "steps", "cpu"):
            common = min(min(r.last(axis) for r in a.values()), min(r.last(axis) for r in b.values()))
            if axis == "samples":
                diff, _ = paired_difference({s: a[s].points(axis)[-1][1] for s in seeds},
                                            {s: b[s].points(axis)[-1][1] for s in seeds})
                reading = verdict(diff, NAMES[arm], NAMES[other])
                label = ""
            else:
                diff, _ = paired_difference({s: a[s].at(axis, common) for s in seeds},
                                            {s: b[s].at(axis, common) for s in seeds})
                label = f" at {common:,.0f}"
            interval = f" [{diff.low:+.1f}, {diff.high:+.1f}]" if diff.n >= 2 else " (1 seed)"
            cells.append(f"{diff.mean:+.1f}{interval}{label}")
        lines.append(f"| {NAMES[arm]} - {NAMES[other]} (seeds {','.join(map(str, seeds))}) | "
                     f"{' | '.join(cells)} | {reading} |")
    return lines


def paired_runs(done: list[RunData], arm: str, other: str) -> tuple[dict, dict, list[int]]:
    """The finished runs of `arm` and of `other` by seed, and the seeds both finished."""
    a = {r.seed: r for r in done if r.arm == arm}
    b = {r.seed: r for r in done if r.arm == other}
    return a, b, sorted(set(a) & set(b))


def curve_table(done: list[RunData], every: int = VAL_EVERY) -> list[str]:
    """Paired differences along the sample axis: at each validation point (interpolated where an arm validated at
    other counts) and averaged over all of them. Many looks at one pair of curves: an interval here that excludes 0
    is a lead to test with more seeds, not a finding."""
    grid = list(range(every, BUDGET + 1, every))
    lines = ["| comparison | " + " | ".join(f"{x:,}" for x in grid) + " | mean over these |",
             "| --- |" + " --- |" * (len(grid) + 1)]
    for arm, other in PAIRS:
        a, b, seeds = paired_runs(done, arm, other)
        if len(seeds) < 2:
            continue
        cells = []
        for xs in [[x] for x in grid] + [grid]:
            diff, _ = paired_difference({s: statistics.mean(a[s].at("samples", x) for x in xs) for s in seeds},
                                        {s: statistics.mean(b[s].at("samples", x) for x in xs) for s in seeds})
            cells.append(f"{diff.mean:+.1f} [{diff.low:+.1f}, {diff.high:+.1f}]")
        lines.append(f"| {NAMES[arm]} - {NAMES[other]} | " + " | ".join(cells) + " |")
    return lines


def cost_table(done: list[RunData]) -> list[str]:
    names = [key.split("/")[-1] for key in TIMINGS]
    lines = ["| arm | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for arm in CPO_ARMS:
        runs = [r for r in done if r.arm == arm]
        if runs:
            cells = []
            for key in TIMINGS:
                values = [v for v in (r.mean_of(key) for r in runs) if v is not None]
                cells.append(f"{statistics.mean(values):.1f}" if values else "-")
            lines.append(f"| {NAMES[arm]} | " + " | ".join(cells) + " |")
    return lines


def mi_table(done: list[RunData]) -> list[str]:
    names = [key.split("/")[-1] for key in MI_KEYS]
    lines = ["| where | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
    for arm in ("cpo", "cpo_grpo"):
        runs = [r for r in done if r.arm == arm]
        if runs:
            cells = []
            for key in MI_KEYS:
                values = [v for v in (r.mean_of(key) for r in runs) if v is not None]
                cells.append(f"{statistics.mean(values):.3g}" if values else "not scored")
            lines.append(f"| {NAMES[arm]}, mean over steps | " + " | ".join(cells) + " |")
    if BENCH.is_file():  # the start model, every response of the captured GRPO batch scored under its hint
        rows = [json.loads(line) for line in BENCH.read_text().splitlines() if line.strip()]
        full = [r for r in rows if r.get("setting") == "cpo_grpo_before"]
        if full:
            cells = [f"{statistics.mean(r[k] for r in full if k in r):.3g}" if any(k in r for r in full) else "-"
                     for k in MI_KEYS]
            lines.append("| start model, captured GRPO batch, every response hinted | " + " | ".join(cells) + " |")
    tiny = [read_rows(path) for path in sorted(TINY.glob("seed*/metrics.jsonl"))]
    if tiny:
        def tiny_mean(key: str) -> str:
            values = [row[key] for rows in tiny for step, row in rows.items() if step > 0 and key in row]
            return f"{statistics.mean(values):.3g}" if values else "-"
        lines.append("| tiny model, learning table (a) CPO, all scored tokens (right and wrong together) | "
                     + " | ".join(tiny_mean(k) if k in ("cpo/shaped_token_frac", "cpo/mi_positive_ratio")
                                  else "-" for k in MI_KEYS) + " |")
    return lines


def plot(done: list[RunData], out_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    colors = dict(zip(CPO_ARMS, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for axis, label in AXES.items():
        figure, ax = plt.subplots(figsize=(7, 4.5))
        for arm in CPO_ARMS:
            runs = [r for r in done if r.arm == arm]
            for index, run in enumerate(runs):
                xs, ys = zip(*run.points(axis))
                ax.plot(xs, ys, color=colors[arm], alpha=0.35, linewidth=1, marker=".",
                        label=f"{NAMES[arm]} ({len(runs)} seed{'s' * (len(runs) > 1)})" if not index else None)
            if len(runs) > 1:
                top = min(r.last(axis) for r in runs)
                grid = [top * i / 40 for i in range(41)]
                ax.plot(grid, [statistics.mean(r.at(axis, x) for r in runs) for x in grid], color=colors[arm],
                        linewidth=2.2)
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy, greedy (%)")
        ax.set_title(f"SmolLM2-135M, two-digit addition: accuracy against {label}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        path = out_dir / f"compare_cpo_{axis}.png"
        figure.tight_layout()
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def report(runs: list[RunData]) -> dict[str, list[str]]:
    done = [r for r in runs if r.finished]
    status = ", ".join(f"{r.arm}/seed{r.seed}" + ("" if r.finished else f" (not finished: {max(r.rows, default=0)} "
                                                                         "steps logged)") for r in runs)
    ends = [r.last("samples") for r in done if r.last("samples") > BUDGET]
    past = f"{min(ends):,.0f}-{max(ends):,.0f}" if ends else "none did here"
    head = textwrap.wrap(f"Runs read: {status or 'none'}. Numbers below are over the finished runs only.", 120,
                         break_on_hyphens=False) + [""]
    head += textwrap.wrap("Held-out accuracy (greedy, 200 questions; mean ± one standard error over seeds). The budget "
                          "ends a run at the step that reaches 2,560 generated samples: filter-groups' arms end past "
                          f"it ({past}), so their 'budget's end' is a little more than GRPO's; the table along the "
                          "way compares every arm at exactly 2,560:", 120) + [""]
    rows = final_table(done)
    return {"when": head
            + rows + ["", "Paired differences by seed, in points (95% t interval over seeds):", ""]
            + paired_table(done) + ["", "Along the way: paired differences at each count of generated samples, in "
                                    "points (95% t interval over seeds):", ""]
            + curve_table(done) + ["", "What a step cost (means over steps and seeds, in wall seconds, which move "
                                        "with the machine's load):", ""]
            + cost_table(done) + ["", "The hint's signal (MI quantiles over scored tokens; 'not scored': the rule "
                                      "read no hint there):", ""] + mi_table(done),
            "rows": rows}


def write_block(path: Path, name: str, lines: list[str]) -> None:
    start, end = f"<!-- compare_cpo:{name}:start (benchmarks/real_model/compare_cpo_report.py) -->", \
        f"<!-- compare_cpo:{name}:end -->"
    text = path.read_text()
    if start not in text or end not in text:
        raise SystemExit(f"error: {path} has no {start} ... {end} block to regenerate")
    before, rest = text.split(start, 1)
    path.write_text(before + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--write", action="store_true", help="regenerate the blocks in docs/cpo.md and docs/status.md")
    parser.add_argument("--png-dir", default=str(HERE))
    args = parser.parse_args(argv)
    runs = load_runs()
    sections = report(runs)
    print("\n".join(sections["when"]))
    done = [r for r in runs if r.finished]
    if done:
        for path in plot(done, Path(args.png_dir)):
            print(f"wrote {path}")
    if args.write:
        for path, name in DOCS.items():
            write_block(path, name, sections[name])
            print(f"regenerated the {name} block of {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
