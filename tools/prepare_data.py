"""Turn GSM8K, MATH, AIME, GPQA and code-contest release files into verl-schema parquet for training and eval.

    python tools/prepare_data.py --kind gsm8k --input gsm8k/train.jsonl --output data/gsm8k_train.parquet
    python tools/prepare_data.py --kind math --input MATH-500/test.jsonl --output data/math500.parquet --split test
    python tools/prepare_data.py --kind verl --input ~/data/gsm8k/train.parquet --output data/gsm8k_checked.parquet
    python tools/prepare_data.py --kind verl --input ~/data/math/train.parquet --output data/math_hints.parquet \
        --attach-solutions MATH/train.jsonl --solutions-kind math
    python tools/prepare_data.py --kind gsm8k --input gsm8k/train.jsonl --output data/gsm8k_tool.parquet \
        --agent-name tool_agent --tool-ground-truth calc_gsm8k_reward --interaction gsm8k --system-prompt "..."

Input files are read in their usual release formats: JSON lines, a JSON list (or {"data": [...]}), CSV (GPQA) and
parquet. Every output row holds `prompt` (one user message: the question and the dataset's instruction),
`data_source` (which picks the grader in `megatron_cpo.rewards`), `ability`, `reward_model.ground_truth` and
`extra_info` with `split`, `index`, `question` and the gold `solution` that CPO shows as its hint.

Rows already in verl's schema (`data_source`, `prompt`, `reward_model`: what verl's own preprocessing scripts write)
are validated and passed through unchanged, whatever `--kind` says (`--kind verl` accepts only such rows); with
`--attach-solutions` the gold solutions of a raw release are added to them as `extra_info.solution` (see
`verl_rows.py`), so CPO's hint is a worked solution rather than the bare answer.

Multi-turn rows (docs/multi_turn.md) in the shape of verl's `gsm8k_multiturn_w_tool.py` / `_w_interaction.py`:
`--agent-name` sets the `agent_name` column, `--tool-ground-truth TOOL` gives the tool the row's answer
(`extra_info.tools_kwargs.TOOL.create_kwargs.ground_truth`), `--interaction NAME` adds
`extra_info.interaction_kwargs` (`name`, `query`, `ground_truth`), `--system-prompt` puts a system message first.

Bad rows are never dropped silently: every one is named (file, row number, what is wrong). By default any bad row
stops the run before anything is written; `--skip-bad-rows` writes the good rows and still lists the bad ones.
Converted rows are checked with the dataset reader's own validator, so a file this tool writes is one training reads.
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data_sources import SOURCES, RecordError  # noqa: E402
from verl_rows import VERL_FIELDS, SolutionIndex, attach_solutions, is_verl_row, pass_through  # noqa: E402

from megatron_cpo.data.dataset import DataValidationError, row_problems  # noqa: E402
from megatron_cpo.data.synthetic import write_parquet as write_rows  # noqa: E402
from megatron_cpo.rewards.registry import missing_graders  # noqa: E402

READABLE_SUFFIXES = (".jsonl", ".json", ".csv", ".parquet")
VERL_KIND = "verl"


def read_records(path: str | Path) -> list[tuple[str, Any]]:
    """(where, record) for every record of one input file, format chosen by suffix. `where` is "line N" (1-based)
    for JSON lines and "row N" (0-based) otherwise; a JSONL line that does not parse is kept as an error record so
    that it is reported with the others instead of stopping the read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"input file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        records: list[tuple[str, Any]] = []
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                records.append((f"line {number}", json.loads(line)))
            except json.JSONDecodeError as error:
                records.append((f"line {number}", RecordError(f"not valid JSON ({error.msg} at column {error.colno})")))
        return records
    if suffix == ".json":
        data = json.loads(path.read_text(encoding="utf-8"))
        if isinstance(data, dict) and isinstance(data.get("data"), list):
            data = data["data"]
        if not isinstance(data, list):
            raise ValueError(f"{path}: a .json input must hold a list of records or {{\"data\": [...]}}; "
                             "use .jsonl for one record per line")
    elif suffix == ".csv":
        with path.open(newline="", encoding="utf-8") as handle:
            data = list(csv.DictReader(handle))
    elif suffix == ".parquet":
        import pyarrow.parquet as pq

        data = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: unsupported suffix {suffix!r}; give one of {', '.join(READABLE_SUFFIXES)}")
    return [(f"row {number}", record) for number, record in enumerate(data)]


@dataclass
class PrepareResult:
    """Rows converted from the inputs and one message per bad input row."""

    rows: list[dict[str, Any]]
    problems: list[str]
    notes: list[str] = field(default_factory=list)


def to_verl_row(record: Any, kind: str, split: str, index: int, data_source: str | None = None,
                instruction: str | None = None) -> dict[str, Any]:
    """Convert one source record into a verl-schema row; raises RecordError saying what is wrong."""
    if isinstance(record, RecordError):
        raise record
    if not isinstance(record, dict):
        raise RecordError(f"record must be an object with named fields, got {type(record).__name__}")
    if is_verl_row(record):
        row = pass_through(record)
        return {**row, "data_source": data_source} if data_source else row
    if kind == VERL_KIND:
        absent = ", ".join(repr(name) for name in VERL_FIELDS if name not in record)
        raise RecordError(f"not a verl-schema row: missing field(s) {absent}")
    source = SOURCES[kind]
    converted = source.convert(record)
    prompt_text = f"{converted.question}\n\n{instruction if instruction is not None else source.instruction}".strip()
    extra_info = {"split": split, "index": index, "question": converted.question, **converted.extra}
    if converted.solution:
        extra_info["solution"] = converted.solution
    row = {
        "data_source": data_source or source.data_source,
        "prompt": [{"role": "user", "content": prompt_text}],
        "ability": source.ability,
        "reward_model": {"style": "rule", "ground_truth": converted.ground_truth},
        "extra_info": extra_info,
    }
    problems = row_problems(row)
    if problems:
        raise RecordError("; ".join(problems))
    return row


def prepare(inputs: list[str | Path], kind: str, split: str = "train", data_source: str | None = None,
            instruction: str | None = None, limit: int = 0) -> PrepareResult:
    """Read and convert every input file; collects (never raises on) bad rows so that all are reported at once."""
    if kind not in SOURCES and kind != VERL_KIND:
        raise ValueError(f"--kind {kind!r} is not supported; choose one of {', '.join([*SOURCES, VERL_KIND])}")
    rows, problems = [], []
    for path in inputs:
        for where, record in read_records(path):
            if limit and len(rows) >= limit:
                break
            try:
                rows.append(to_verl_row(record, kind, split, len(rows), data_source, instruction))
            except RecordError as error:
                problems.append(f"{path} {where}: {error}")
    return PrepareResult(rows, problems)


def add_solutions(result: PrepareResult, raw_inputs: list[str | Path], kind: str, overwrite: bool = False) -> None:
    """Attach the gold solutions of the raw release files `raw_inputs` (read as `--kind kind`) to the rows; bad raw
    records and rows left without a solution are listed in `result.notes` (they do not stop the run)."""
    if kind not in SOURCES:
        raise ValueError(f"--attach-solutions needs the raw files' format: pass --solutions-kind, one of "
                         f"{', '.join(SOURCES)} (got {kind!r})")
    records = [(f"{path} {where}", record) for path in raw_inputs for where, record in read_records(path)]
    index = SolutionIndex(records, kind)
    unmatched = attach_solutions(result.rows, index, overwrite)
    result.notes += [f"raw solutions: {problem}" for problem in index.problems]
    if unmatched:
        shown = ", ".join(map(str, unmatched[:20])) + (" ..." if len(unmatched) > 20 else "")
        result.notes.append(f"{len(unmatched)} of {len(result.rows)} rows found no solution in {len(index.by_question)}"
                            f" raw records (rows {shown}); their hint stays what data.hint_key finds")


def add_multi_turn_fields(rows: list[dict[str, Any]], agent_name: str = "", tools: list[str] | None = None,
                          interaction: str = "", system_prompt: str = "") -> None:
    """Give rows verl's multi-turn fields (in place): the agent, the tools' and the interaction's kwargs, a system
    message."""
    for row in rows:
        info, truth = row["extra_info"], row["reward_model"]["ground_truth"]
        question = info.get("question", row["prompt"][-1]["content"])
        if agent_name:
            row["agent_name"] = agent_name
        if tools:
            info["need_tools_kwargs"] = True
            info["tools_kwargs"] = {tool: {"create_kwargs": {"ground_truth": truth}} for tool in tools}
        if interaction:
            info["interaction_kwargs"] = {"name": interaction, "query": question, "ground_truth": truth}
        if system_prompt and row["prompt"][0]["role"] != "system":
            row["prompt"] = [{"role": "system", "content": system_prompt}, *row["prompt"]]


def _uniform_extra_info(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Give every row the same extra_info keys (None where absent) so parquet stores one struct type."""
    keys = sorted({key for row in rows for key in row["extra_info"]})
    return [{**row, "extra_info": {key: row["extra_info"].get(key) for key in keys}} for row in rows]


def write_parquet(rows: list[dict[str, Any]], output: str | Path) -> Path:
    """Write rows to `output` (parent folders created); refuses to write an empty file."""
    if not rows:
        raise ValueError(f"no rows to write to {output}; every input row was bad (see the list above)")
    return write_rows(_uniform_extra_info(rows), output)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--kind", required=True, choices=sorted([*SOURCES, VERL_KIND]),
                        help="dataset the input files come from; 'verl' for parquet already in verl's schema")
    parser.add_argument("--input", required=True, nargs="+", help="local files: .jsonl, .json, .csv or .parquet")
    parser.add_argument("--output", required=True, help="parquet file to write")
    parser.add_argument("--split", default="train", help="stored in extra_info.split (train/test)")
    parser.add_argument("--data-source", default=None,
                        help="override data_source (picks the grader), e.g. aime2025 or math500")
    parser.add_argument("--instruction", default=None, help="text appended to every question (default per kind)")
    parser.add_argument("--limit", type=int, default=0, help="keep at most this many rows (0: all)")
    parser.add_argument("--attach-solutions", nargs="+", default=None, metavar="RAW",
                        help="raw release files whose gold solutions go to extra_info.solution (CPO's hint)")
    parser.add_argument("--solutions-kind", default=None, choices=sorted(SOURCES),
                        help="format of the --attach-solutions files (default: --kind)")
    parser.add_argument("--overwrite-solutions", action="store_true",
                        help="replace an extra_info.solution a row already has")
    parser.add_argument("--agent-name", default="", help="multi-turn: the rows' agent_name (e.g. tool_agent)")
    parser.add_argument("--tool-ground-truth", nargs="+", default=None, metavar="TOOL",
                        help="multi-turn: tools given the row's answer (extra_info.tools_kwargs.TOOL.create_kwargs)")
    parser.add_argument("--interaction", default="", help="multi-turn: extra_info.interaction_kwargs.name")
    parser.add_argument("--system-prompt", default="", help="a system message before each prompt")
    parser.add_argument("--skip-bad-rows", action="store_true",
                        help="write the good rows even when some are bad (bad ones are still listed)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Command-line entry; returns the exit status (2 when bad rows stop the run)."""
    args = build_parser().parse_args(argv)
    try:
        result = prepare(args.input, args.kind, args.split, args.data_source, args.instruction, args.limit)
        if args.attach_solutions:
            add_solutions(result, args.attach_solutions, args.solutions_kind or args.kind, args.overwrite_solutions)
        add_multi_turn_fields(result.rows, args.agent_name, args.tool_ground_truth, args.interaction,
                              args.system_prompt)
        missing = missing_graders(row["data_source"] for row in result.rows)
        if missing:
            result.notes.append(f"no built-in grader for data_source {', '.join(map(repr, missing))}; training "
                                "needs reward.custom_graders or custom_reward_function for them")
        for note in result.notes:
            print(f"note: {note}", file=sys.stderr)
        if result.problems:
            error = DataValidationError(", ".join(map(str, args.input)), result.problems)
            print(f"{'warning' if args.skip_bad_rows else 'error'}: {error}", file=sys.stderr)
            if not args.skip_bad_rows:
                print("nothing written; fix the rows above or pass --skip-bad-rows", file=sys.stderr)
                return 2
        path = write_parquet(result.rows, args.output)
    except (FileNotFoundError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {len(result.rows)} rows to {path} ({len(result.problems)} bad rows skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
