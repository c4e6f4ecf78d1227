"""Prompt datasets in verl's parquet schema (the trainer walks them with `trainer.prompt_stream.PromptStream`).

`read_rows` is the one place rows are checked, for both preflight and `PromptDataset`, naming every bad row at once.
Rows are tokenized once with the chat template; overlong prompts follow verl's policy (drop, or `truncation`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_cpo.data.config import DataConfig

MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class DataValidationError(ValueError):
    """A dataset file that does not follow the verl schema; `problems` lists one line per bad row (or the one
    problem of the whole file: no rows, no prompt column)."""

    def __init__(self, source: str, problems: list[str], rows: bool = True):
        self.problems = problems
        if not rows:
            super().__init__(f"{source}: {problems[0]}")
            return
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} bad row(s) in {source}:\n  {shown}{more}")


@dataclass
class PromptRecord:
    """One prompt ready for rollout: ids to generate from and what the reward function needs to score it."""

    uid: str
    index: int
    messages: list[dict[str, str]]
    prompt_ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any] = field(default_factory=dict)
    reward_model: dict[str, Any] = field(default_factory=dict)
    agent_name: str = ""  # verl's `agent_name` column: the environment of a multi-turn episode ("" for the default)


def _message_problems(messages: Any) -> list[str]:
    if not isinstance(messages, (list, tuple)):
        return [f"prompt must be a list of chat messages, got {type(messages).__name__}"]
    if len(messages) == 0:
        return ["prompt is an empty list of messages"]
    problems = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            problems.append(f"prompt[{i}] must be a dict with 'role' and 'content', got {type(message).__name__}")
            continue
        role, content = message.get("role"), message.get("content")
        if role not in MESSAGE_ROLES:
            problems.append(f"prompt[{i}].role={role!r} is not one of {MESSAGE_ROLES}")
        if not isinstance(content, str):
            problems.append(f"prompt[{i}].content must be a string, got {type(content).__name__}")
    if not problems and not any(m["content"].strip() for m in messages):
        problems.append("prompt has no message with non-empty content")
    if not problems and not any(m["role"] == "user" for m in messages):
        problems.append("prompt has no user message")
    return problems


def _ground_truth_problem(reward_model: Any, needs_ground_truth: bool) -> str | None:
    if reward_model is None:
        return "missing field 'reward_model'"
    if not isinstance(reward_model, dict):
        return f"reward_model must be a dict, got {type(reward_model).__name__}"
    truth = reward_model.get("ground_truth")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        if not needs_ground_truth:
            return None
        return ("missing field 'reward_model.ground_truth'" if truth is None else
                "reward_model.ground_truth is empty: no response can be graded right against it; fill in the answer "
                "or drop the row (or grade every response with reward.custom_reward_function)")
    if not isinstance(truth, (str, int, float, dict, list)) or isinstance(truth, bool):
        return (f"reward_model.ground_truth must be a string or number (or a dict/list such as Search-R1's "
                f"{{'target': [...]}}), got {type(truth).__name__}")
    return None


def row_problems(row: dict[str, Any], prompt_key: str = "prompt", needs_ground_truth: bool = True) -> list[str]:
    """What is wrong with one row of the verl schema (empty list when it is valid).

    `needs_ground_truth`: the data source's grader compares every response with `reward_model.ground_truth`, so a
    missing or blank one is refused; False when one `reward.custom_reward_function` grades every response (it may
    not read the ground truth, e.g. verl's reward-model data sets keep it empty)."""
    problems = []
    if prompt_key not in row or row[prompt_key] is None:
        problems.append(f"missing field '{prompt_key}'")
    else:
        problems += _message_problems(row[prompt_key])
    source = row.get("data_source")
    if source is None:
        problems.append("missing field 'data_source'")
    elif not isinstance(source, str) or not source:
        problems.append(f"data_source must be a non-empty string, got {source!r}")
    truth_problem = _ground_truth_problem(row.get("reward_model"), needs_ground_truth)
    if truth_problem:
        problems.append(truth_problem)
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        problems.append(f"extra_info must be a dict, got {type(extra_info).__name__}")
    return problems


def validate_rows(rows: list[dict[str, Any]], source: str, prompt_key: str = "prompt",
                  needs_ground_truth: bool = True) -> None:
    """Raise DataValidationError naming every bad row (`source` row index: problem; ...)."""
    problems = []
    for i, row in enumerate(rows):
        found = row_problems(row, prompt_key, needs_ground_truth)
        if found:
            problems.append(f"row {i}: " + "; ".join(found))
    if problems:
        raise DataValidationError(source, problems)


def read_parquet_rows(path: str | Path) -> list[dict[str, Any]]:
    """All rows of one parquet file as dicts."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {str(path)!r} does not exist; check data.train_files / data.val_files")
    return pq.read_table(path).to_pylist()


def read_rows(path: str | Path, prompt_key: str = "prompt", needs_ground_truth: bool = True) -> list[dict[str, Any]]:
    """All rows of one verl-schema parquet file, checked: `FileNotFoundError` when it is missing, else
    `DataValidationError` when it has no rows, no `prompt_key` column, or bad rows (every one named)."""
    rows = read_parquet_rows(path)
    if not rows:
        raise DataValidationError(str(path), ["has no rows; give a file with prompts in it"], rows=False)
    if prompt_key not in rows[0]:
        raise DataValidationError(str(path), [
            f"data.prompt_key={prompt_key!r} is not a column (columns: {', '.join(rows[0])}); set data.prompt_key to "
            "the column holding the chat messages"], rows=False)
    validate_rows(rows, str(path), prompt_key, needs_ground_truth)
    return rows


def render_prompts(tokenizer, conversations: list[list[dict[str, str]]]) -> list[str]:
    """Chat-template text of each conversation followed by the assistant generation prompt."""
    return [tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            for messages in conversations]


def encode_texts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text (one batched call; special tokens come from the rendered template, not added)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def fit_prompt(ids: list[int], max_length: int, truncation: str, where: str) -> list[int]:
    """Apply verl's truncation policy to one tokenized prompt."""
    if len(ids) <= max_length:
        return ids
    if truncation == "left":
        return ids[-max_length:]
    if truncation == "right":
        return ids[:max_length]
    raise ValueError(f"{where}: prompt has {len(ids)} tokens > max_prompt_length={max_length}; raise "
                     f"data.max_prompt_length, set data.truncation=left|right, or data.filter_overlong_prompts=true")


def _ground_truth(value: Any) -> Any:
    """Scalars as text (verl's graders compare strings); structured truths (Search-R1's {'target': [...]},
    code tests as a dict) and a missing one (None) unchanged."""
    return value if value is None or isinstance(value, (dict, list)) else str(value)


class PromptDataset:
    """Checked (`read_rows`), tokenized prompt records from one or more verl-schema parquet files, fitted to
    `data.max_prompt_length` as `data.truncation` / `data.filter_overlong_prompts` say (`config`, default
    `DataConfig()`). `needs_ground_truth`: see `row_problems`."""

    def __init__(self, files: str | Path | list[str], tokenizer: Any, config: DataConfig | None = None,
                 needs_ground_truth: bool = True) -> None:
        self.config = config = config or DataConfig()
        self.files = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
        if not self.files:
            raise ValueError("data files list is empty; set data.train_files to one or more parquet files")
        rows, where = [], []
        for path in self.files:
            file_rows = read_rows(path, config.prompt_key, needs_ground_truth)
            rows += file_rows
            where += [f"{path} row {i}" for i in range(len(file_rows))]
        conversations = [[dict(role=m["role"], content=m["content"]) for m in row[config.prompt_key]] for row in rows]
        token_ids = encode_texts(tokenizer, render_prompts(tokenizer, conversations))
        self.num_filtered = 0
        self.records: list[PromptRecord] = []
        for row, messages, ids, row_where in zip(rows, conversations, token_ids, where):
            if config.filter_overlong_prompts and len(ids) > config.max_prompt_length:
                self.num_filtered += 1
                continue
            reward_model = dict(row["reward_model"])
            self.records.append(PromptRecord(
                uid="",
                index=len(self.records),
                messages=messages,
                prompt_ids=fit_prompt(ids, config.max_prompt_length, config.truncation, row_where),
                data_source=row["data_source"],
                ground_truth=_ground_truth(reward_model.get("ground_truth")),
                extra_info=dict(row.get("extra_info") or {}),
                reward_model=reward_model,
                agent_name=str(row.get("agent_name") or ""),
            ))
        if not self.records:
            raise ValueError(f"no prompts left in {self.files} after filtering {self.num_filtered} overlong ones; "
                             f"raise data.max_prompt_length={config.max_prompt_length}")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]
