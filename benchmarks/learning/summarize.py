"""Summarize the learning runs into the tables of benchmarks/learning/README.md and the curve PNGs beside it.

    python benchmarks/learning/summarize.py            # rewrites the README's generated section and the PNGs

Reads every `runs/<task>/<algo>/seed<k>/run.json` + `metrics.jsonl` that `run_table.py` wrote (the plan of runs is
`tasks.py`'s). The change of a run is `val/acc` at its last step minus `val/acc` before training, in points; per
algorithm: mean, sample std and a t-distribution 95% interval over seeds; paired comparisons take the per-seed
difference of changes. Runs that did not finish are listed with their commands. Only the section between the README's
`generated` markers is rewritten.
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from stats import binomial_se, paired_difference, summarize, verdict  # noqa: E402
from tasks import SEEDS, TABLES, TEACHER_RUN, plan  # noqa: E402

START, END = "<!-- generated:start (summarize.py) -->", "<!-- generated:end -->"
NEVER_SEEN = "val/megatron_cpo/arith/acc"
COMPARISONS = {"a": [("cpo", "grpo"), ("dapo", "grpo"), ("cpo", "dapo")],
               "b": [("cpo", "grpo"), ("dapo", "grpo"), ("cpo", "dapo")],
               "c": [(rule, "cpo") for rule in TABLES["c"][1]] + [(rule, "grpo") for rule in TABLES["c"][1]],
               "d": [("grpo_k1", "grpo"), ("dapo_k1", "dapo"), ("cpo_k1", "cpo")],
               "e": [(algo, "grpo") for algo in TABLES["e"][1]],
               "f": [("opd", "grpo"), ("opd_task", "grpo"), ("opsd", "grpo"), ("opd_task", "opd"), ("opsd", "opd")]}
TABLE_TITLES = {"a": "(a) the shipped task (levels 1-2), 400 held-out questions",
                "b": "(b) the harder variant (levels 1-3), 595 held-out questions",
                "c": "(c) CPO rule ablation on the shipped task (same seeds as (a))",
                "d": "(d) asynchronous training at k = 1 on the shipped task (same seeds as (a))",
                "e": "(e) verl's other estimators and loss modes on the shipped task (same seeds as (a))",
                "f": "(f) on-policy distillation from a GRPO-trained teacher on the shipped task (same seeds as (a))"}
ALGO_NAMES = {"grpo": "GRPO", "dapo": "DAPO", "cpo": "CPO negonly_mi3", "grpo_k1": "GRPO k=1", "dapo_k1": "DAPO k=1",
              "cpo_k1": "CPO negonly_mi3 k=1", "ppo": "PPO (GAE + critic)", "rloo": "RLOO",
              "reinforce_plus_plus": "REINFORCE++", "gspo": "GSPO", "opd": "OPD", "opd_task": "OPD + task",
              "opsd": "OPSD",
              "teacher": "the teacher (GRPO)"}


@dataclass
class RunResult:
    task: str
    algo: str
    seed: int
    record: dict
    val: dict[int, float]          # step -> val/acc
    never_seen: dict[int, float]   # step -> val/acc on the questions the warm start never saw
    count: int
    sources: dict[str, tuple[float, float]]  # held-out data source -> (first, last) val acc

    def sources_text(self) -> str:
        return "; ".join(f"{source.split('/')[-1]} {100 * first:.1f} -> {100 * last:.1f}"
                         for source, (first, last) in sorted(self.sources.items()))

    @property
    def before(self) -> float:
        return 100 * self.val[min(self.val)]

    @property
    def after(self) -> float:
        return 100 * self.val[max(self.val)]

    @property
    def change(self) -> float:
        return self.after - self.before

    @property
    def never_seen_change(self) -> float:
        return 100 * (self.never_seen[max(self.never_seen)] - self.never_seen[min(self.never_seen)])


def algo_name(algo: str) -> str:
    return ALGO_NAMES.get(algo, f"CPO {algo[4:]}" if algo.startswith("cpo_") else algo)


def load(run_dir: Path) -> RunResult | None:
    """A finished run's result, or None when it did not finish or logged fewer than two validations."""
    record_path, metrics_path = run_dir / "run.json", run_dir / "metrics.jsonl"
    if not record_path.is_file() or not metrics_path.is_file():
        return None
    record = json.loads(record_path.read_text())
    val, never_seen, count, by_source = {}, {}, 0, {}
    for line in metrics_path.read_text().splitlines():
        row = json.loads(line)
        for key, value in row.items():
            if key.startswith("val/") and key.endswith("/acc") and key != "val/acc":
                by_source.setdefault(key[4:-4], []).append(float(value))
        if "val/acc" in row:
            val[int(row["step"])] = float(row["val/acc"])
            never_seen[int(row["step"])] = float(row.get(NEVER_SEEN, math.nan))
            count = int(row.get("val/count", count))
    if record.get("returncode") != 0 or len(val) < 2:
        return None
    sources = {source: (values[0], values[-1]) for source, values in by_source.items()}
    return RunResult(record["task"], record["algo"], int(record["seed"]), record, val, never_seen, count, sources)


def collect(root: Path = HERE / "runs") -> list[RunResult]:
    results = [load(path.parent) for path in sorted(root.glob("*/*/seed*/run.json"))]
    return [result for result in results if result is not None]


def fmt(value: float, digits: int = 1, sign: bool = False) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def interval(summary) -> str:
    return "-" if summary.n < 2 else f"[{summary.low:+.1f}, {summary.high:+.1f}]"


def table_markdown(table: str, results: list[RunResult]) -> list[str]:
    """Per-algorithm summary, paired comparisons and per-run rows of one table."""
    task, algos = TABLES[table]
    algos = ("cpo",) + algos if table == "c" else algos
    by_algo = {algo: {r.seed: r for r in results if r.task == task and r.algo == algo} for algo in algos}
    lines = [f"### {TABLE_TITLES[table]}", ""]
    if not any(by_algo.values()):
        return lines + ["No run of this table finished.", ""]
    count = next(r.count for runs in by_algo.values() for r in runs.values())
    before = next(r.before for runs in by_algo.values() for r in runs.values())
    lines += [f"Held-out: {count} questions, greedy; before training every run scores {fmt(before)}% (one standard "
              f"error of a single evaluation there: {100 * binomial_se(before / 100, count):.1f} points). Changes "
              "are in points of `val/acc` (last step minus before training).", "",
              "| algorithm | seeds | after (mean) | change: mean | std | 95% interval | change on the 282 never-seen "
              "level-1/2 questions (mean) | CPU s / run |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if table == TEACHER_RUN.table:
        lines[-2:-2] = teacher_lines(results)
    changes = {}
    for algo, runs in by_algo.items():
        if not runs:
            lines.append(f"| {algo_name(algo)} | 0 | - | - | - | - | - | - |")
            continue
        changes[algo] = {seed: r.change for seed, r in runs.items()}
        s = summarize(list(changes[algo].values()))
        after = summarize([r.after for r in runs.values()]).mean
        unseen = summarize([r.never_seen_change for r in runs.values()]).mean
        cpu = sum(r.record["cpu_s"] for r in runs.values()) / len(runs)
        lines.append(f"| {algo_name(algo)} | {','.join(map(str, sorted(runs)))} | {fmt(after)}% | "
                     f"{fmt(s.mean, sign=True)} | {fmt(s.std)} | {interval(s)} | {fmt(unseen, sign=True)} | "
                     f"{cpu:.0f} |")
    lines += ["", "Paired by seed (difference of changes, points):", "",
              "| comparison | seeds | mean difference | std | 95% interval | reading |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in results:  # comparisons may name an algorithm of another table on the same task (GRPO in (c))
        if r.task == task and r.algo not in by_algo:
            changes.setdefault(r.algo, {})[r.seed] = r.change
    for name, other in COMPARISONS[table]:
        if name not in changes or other not in changes or not set(changes[name]) & set(changes[other]):
            lines.append(f"| {algo_name(name)} - {algo_name(other)} | - | - | - | - | not enough runs |")
            continue
        d, seeds = paired_difference(changes[name], changes[other])
        lines.append(f"| {algo_name(name)} - {algo_name(other)} | {','.join(map(str, seeds))} | "
                     f"{fmt(d.mean, sign=True)} | {fmt(d.std)} | {interval(d)} | "
                     f"{verdict(d, algo_name(name), algo_name(other))} |")
    lines += ["", "<details><summary>Per run</summary>", "",
              "| algorithm | seed | before | after | change | per held-out source, before -> after (%) | wall s "
              "| CPU s | load avg (mean, max) |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for algo, runs in by_algo.items():
        for seed, r in sorted(runs.items()):
            load_avg = r.record["loadavg_1min"]
            lines.append(f"| {algo_name(algo)} | {seed} | {fmt(r.before)}% | {fmt(r.after)}% | "
                         f"{fmt(r.change, sign=True)} | {r.sources_text()} | {r.record['wall_s']:.0f} | "
                         f"{r.record['cpu_s']:.0f} | {load_avg['mean']:.1f}, {load_avg['max']:.1f} |")
    lines += ["", "</details>", ""]
    return lines


def teacher_lines(results: list[RunResult]) -> list[str]:
    """The distillation table's teacher: its run and held-out accuracy at each validation."""
    run = TEACHER_RUN
    teacher = next((r for r in results if (r.task, r.algo, r.seed) == (run.task, run.algo, run.seed)), None)
    if teacher is None:
        return ["The teacher run did not finish.", ""]
    curve = ", ".join(f"{step}: {100 * acc:.1f}%" for step, acc in sorted(teacher.val.items()))
    return [f"Teacher: GRPO (`examples/tiny/grpo_arith.yaml`), seed {run.seed}, {run.steps} steps, its last step kept "
            f"(`runs/{run.task}/{run.algo}/seed{run.seed}/model`, not committed); held-out `val/acc` by step: {curve} "
            f"(never-seen questions {teacher.never_seen_change:+.1f} points); {teacher.record['cpu_s']:.0f} CPU s, "
            f"{teacher.record['wall_s']:.0f} wall s.", ""]


def curves(results: list[RunResult]) -> list[str]:
    """One PNG per table with runs (mean and min-max band across seeds per algorithm); returns the file names."""
    sys.path.insert(0, str(REPO / "tools"))
    from plot_metrics import Panel, plot_groups, read_metrics

    panels = (Panel("Held-out accuracy (val/acc)", ("val/acc",), "fraction correct"),
              Panel("Train accuracy (reward/acc)", ("reward/acc",), "fraction correct"),
              Panel("Response length", ("completions/mean_length",), "tokens"),
              Panel("Entropy", ("actor/entropy",), "nats / token"))
    written = []
    for table, (task, algos) in TABLES.items():
        algos = ("cpo",) + algos if table == "c" else algos
        groups = {}
        for algo in algos:
            runs = [r for r in results if r.task == task and r.algo == algo]
            if runs:
                paths = [HERE / "runs" / task / algo / f"seed{r.seed}" / "metrics.jsonl" for r in runs]
                groups[f"{algo_name(algo)} ({len(runs)} seeds)"] = [read_metrics(path) for path in paths]
        if groups:
            name = f"curves_{table}_{task}.png"
            plot_groups(groups, HERE / name, panels=panels, band="minmax", smoothing=0.6,
                        title=f"{TABLE_TITLES[table]}: mean across seeds, band = min-max, train curves EMA 0.6")
            written.append(name)
    return written


def not_run_lines(results: list[RunResult]) -> list[str]:
    done = {(r.task, r.algo, r.seed) for r in results}
    missing = [run for run in plan([], SEEDS, {}) if (run.task, run.algo, run.seed) not in done]
    if not missing:
        return ["Every planned run finished.", ""]
    lines = [f"{len(missing)} planned runs did not run (or did not finish). Each one's command: "
             "`python benchmarks/learning/run_table.py --only <key>` (`--list --only <key>` prints its trainer "
             "command line):", ""]
    lines += [f"- ({run.table}) `{run.task}/{run.algo}/seed{run.seed}`: key `{run.table}:{run.algo}:{run.seed}`"
              for run in missing]
    return lines + [""]


def generated_section(results: list[RunResult]) -> str:
    cpu = sum(r.record["cpu_s"] for r in results)
    wall = sum(r.record["wall_s"] for r in results)
    loads = [r.record["loadavg_1min"] for r in results]
    load_range = f"{min(x['min'] for x in loads):.1f}-{max(x['max'] for x in loads):.1f}" if loads else "-"
    load_mean = sum(x["mean"] for x in loads) / max(1, len(loads))
    lines = [START, "", f"{len(results)} finished runs; total CPU time {cpu:.0f} s ({cpu / 3600:.2f} h), total wall "
             f"time {wall:.0f} s ({wall / 3600:.2f} h); 1-minute load average during the runs {load_range} (mean of "
             f"run means {load_mean:.1f}) on 2 cores." if results else "No finished run.", ""]
    for table in TABLES:
        lines += table_markdown(table, results)
    pngs = curves(results) if results else []
    lines += ["### Curves", ""] + [f"![{png}]({png})" for png in pngs] + [""]
    lines += ["### Not run", ""] + not_run_lines(results) + [END]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    readme = HERE / "README.md"
    text = readme.read_text() if readme.is_file() else f"# Learning table\n\n{START}\n{END}\n"
    if START not in text or END not in text:
        raise SystemExit(f"{readme} lacks the markers {START} ... {END}; put them where the tables go")
    section = generated_section(collect())
    head, rest = text.split(START, 1)
    readme.write_text(head + section + rest.split(END, 1)[1])
    print(f"wrote {readme}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
