"""The learning section of benchmarks/real_model/README.md, from a run's metrics.jsonl: a PNG and the tables.

    python benchmarks/real_model/learning_report.py RUN_DIR --steps 50 --command "megatron-cpo train ..." \
        [--png benchmarks/real_model/learning_grpo.png] [--answer] [--readme benchmarks/real_model/README.md]

`RUN_DIR` is the trainer's `default_local_dir` (its `metrics.jsonl`; with `--answer`, the last step's Hugging Face
export under `checkpoints/step_<k>/huggingface`). Prints the section; `--readme` puts it in place of the body of the
README's "## Learning" section. Everything in it is read from the run: held-out accuracy at every validation (with
its standard error), the training reward, response length and step time in blocks of steps, the engine-vs-trainer
checks (the sync check after each push, the log-prob mismatch of the sampled tokens), and with `--answer` the greedy
answer of the trained policy's export to the first held-out question (`megatron-cpo generate --hf`), graded.
A run still going gives the section so far, saying how many of `--steps` it logged.
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "tools"))

from plot_metrics import plot, read_metrics  # noqa: E402


def read_rows(path: Path) -> dict[int, dict]:
    """Step -> that step's metrics (a resumed run logs a step twice: its last row wins)."""
    rows: dict[int, dict] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            rows.setdefault(int(row["step"]), {}).update(row)
    return dict(sorted(rows.items()))


def _mean(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values) if values else None


def _max(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if key in row]
    return max(values) if values else None


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def validation_table(rows: dict[int, dict]) -> tuple[list[str], list[tuple[int, float, int]]]:
    """Held-out greedy accuracy at each validation, with its binomial standard error."""
    points = [(step, row["val/acc"], int(row["val/count"])) for step, row in rows.items() if "val/acc" in row]
    lines = ["| step | held-out accuracy | questions | standard error |", "| --- | --- | --- | --- |"]
    for step, acc, count in points:
        lines.append(f"| {step} | {acc:.1%} | {count} | {math.sqrt(acc * (1 - acc) / count):.1%} |")
    return lines, points


def training_table(rows: dict[int, dict], block: int) -> list[str]:
    """Training steps in blocks: sampled reward, response length, step time by phase, the sync checks."""
    lines = ["| steps | reward (sampled) | response tokens | step s | generation s | actor update s | push s | "
             "sync check max diff | mismatch mean / max |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    steps = [step for step in rows if step > 0]
    for first in range(0, len(steps), block):
        chunk = [rows[step] for step in steps[first:first + block]]
        lines.append("| " + " | ".join([
            f"{steps[first]}-{steps[min(first + block, len(steps)) - 1]}",
            _cell(_mean(chunk, "reward/mean"), ".3f"), _cell(_mean(chunk, "response_length/mean"), ".0f"),
            _cell(_mean(chunk, "timing/step_s"), ".0f"), _cell(_mean(chunk, "timing/gen_s"), ".0f"),
            _cell(_mean(chunk, "timing/update_actor_s"), ".0f"), _cell(_mean(chunk, "timing/weight_sync_s"), ".1f"),
            _cell(_max(chunk, "rollout/sync_check_max_abs_diff"), ".3f"),
            f"{_cell(_mean(chunk, 'mismatch/log_probs_diff_mean'), '.3f')} / "
            f"{_cell(_max(chunk, 'mismatch/log_probs_diff_max'), '.2f')}"]) + " |")
    return lines


def answer_held_out(run_dir: Path, last_step: int, test_file: Path) -> list[str]:
    """The trained policy's export answers the first held-out question greedily; graded as training grades it."""
    import pyarrow.parquet as pq

    from megatron_cpo.rewards import compute_score

    saved = {int(path.parent.name.split("_")[-1]): path
             for path in (run_dir / "checkpoints").glob("step_*/huggingface")}  # step_000050/huggingface
    if last_step not in saved:
        raise SystemExit(f"error: no Hugging Face export of step {last_step} under {run_dir / 'checkpoints'}; the run "
                         "has not saved its last step yet")
    export = saved[last_step]
    row = pq.read_table(test_file).slice(0, 1).to_pylist()[0]
    question, expected = row["prompt"][-1]["content"], row["reward_model"]["ground_truth"]
    command = [str(Path(sys.executable).parent / "megatron-cpo"), "generate", "--hf", str(export), "--prompt",
               question, "--max-new-tokens", "128"]
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    line = next(line for line in printed.splitlines() if line.startswith("generation ("))
    text = ast.literal_eval(line.split(": ", 1)[1])
    result = compute_score(row["data_source"], text, expected)
    where = export.relative_to(REPO) if export.is_relative_to(REPO) else export
    return [f"The trained policy's Hugging Face export (`{where}`), greedy, on the first held-out question "
            f"(`megatron-cpo generate --hf <export> --prompt "
            f"\"{question}\" --max-new-tokens 128`):", "", "    " + text.replace("\n", "\n    "), "",
            f"expected {expected}, graded answer {result.get('pred')}: **{'correct' if result['acc'] else 'wrong'}**."]


def section(run_dir: Path, rows: dict[int, dict], total_steps: int, command: str, png: Path, block: int,
            answer: list[str]) -> str:
    val_lines, points = validation_table(rows)
    trained = max((step for step in rows if step > 0), default=0)
    status = (f"all {total_steps} steps" if trained >= total_steps
              else f"**still running: {trained} of {total_steps} steps logged so far**")
    shown = " \\\n        ".join(textwrap.wrap(command, 100, break_long_words=False, break_on_hyphens=False))
    parts = [f"One GRPO run (`examples/smollm2-135m/grpo.yaml`, seed 1), {status}:", "", f"    {shown}", "",
             f"![learning curves]({png.name})", "", "Held-out accuracy (greedy, the first "
             f"{points[0][2] if points else '?'} held-out questions):", "", *val_lines, ""]
    if len(points) >= 2:
        (_, first, count), (last_step, last, _) = points[0], points[-1]
        error = math.sqrt(first * (1 - first) / count + last * (1 - last) / count)
        parts += [f"From step 0 to step {last_step}: {first:.1%} -> {last:.1%}, "
                  f"{(last - first) * 100:+.1f} points (standard error of the difference {error * 100:.1f} points; "
                  "the issue's target is +15 points).", ""]
    parts += ["Training, in blocks of steps (means; the checks' maxima): the sync check compares the engine's greedy "
              "log-probs on fixed probe prompts with the trainer's right after each weight push (tolerance 0.5 for "
              "the bf16 actor); the mismatch is |engine - trainer| log-prob of the sampled tokens.", "",
              *training_table(rows, block), ""]
    if answer:
        parts += [*answer, ""]
    return "\n".join(line if line.startswith(("|", "    ")) else "\n".join(textwrap.wrap(line, 118)) or line
                     for line in parts)


def replace_section(readme: Path, title: str, body: str) -> None:
    text = readme.read_text()
    start = text.index(f"\n{title}\n") + len(title) + 2
    end = text.find("\n## ", start)
    readme.write_text(text[:start] + "\n" + body + ("\n" + text[end:] if end != -1 else ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's trainer.default_local_dir")
    parser.add_argument("--steps", type=int, required=True, help="the run's trainer.total_training_steps")
    parser.add_argument("--command", required=True, help="the command the run was started with, as printed")
    parser.add_argument("--png", type=Path, default=HERE / "learning_grpo.png")
    parser.add_argument("--block", type=int, default=10, help="steps per row of the training table")
    parser.add_argument("--answer", action="store_true", help="the trained export answers a held-out question")
    parser.add_argument("--test-file", type=Path, default=REPO / "outputs/addition/test.parquet")
    parser.add_argument("--readme", type=Path, default=None, help="write the section into this README")
    args = parser.parse_args(argv)
    metrics = args.run_dir / "metrics.jsonl"
    rows = read_rows(metrics)
    plot([read_metrics(metrics)], ["GRPO seed 1"], args.png, title="SmolLM2-135M-Instruct, two-digit addition")
    trained = max((step for step in rows if step > 0), default=0)
    answer = answer_held_out(args.run_dir, trained, args.test_file) if args.answer else []
    body = section(args.run_dir, rows, args.steps, args.command, args.png, args.block, answer)
    print(body)
    if args.readme:
        replace_section(args.readme, "## Learning", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
