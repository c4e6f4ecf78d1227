"""Prompt datasets in verl's parquet schema (the trainer walks them with `trainer.prompt_stream.PromptStream`).

A row holds `prompt` (chat messages), `data_source`, `reward_model.ground_truth` and optional `extra_info`, as in
verl's RLHFDataset. Rows are validated once when the files are read (every bad row is named with what is wrong, so a
user fixes the file in one pass) and tokenized once with the tokenizer's chat template and the assistant generation
prompt. Prompts longer than `max_prompt_length` follow verl's policy: drop them (`filter_overlong_prompts`), or
`truncation="error" | "left" | "right"`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal


TRUNCATION_MODES = ("error", "left", "right")
MESSAGE_ROLES = ("system", "user", "assistant", "tool")


class DataValidationError(ValueError):
    """Rows of a dataset file that do not follow the verl schema; `problems` lists one line per bad row."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        shown = "\n  ".join(problems[:50])
        more = f"\n  ... and {len(problems) - 50} more" if len(problems) > 50 else ""
        super().__init__(f"{len(problems)} bad row(s) in {source}:\n  {shown}{more}")


@dataclass
class DatasetConfig:
    """Which parquet files to read and how to fit prompts into `max_prompt_length` tokens (verl's `data.*` keys)."""

    files: list[str]
    max_prompt_length: int = 512
    truncation: Literal["error", "left", "right"] = "error"
    filter_overlong_prompts: bool = False
    prompt_key: str = "prompt"
    shuffle: bool = True
    seed: int = 0
    check_graders: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.files, (str, Path)):
            self.files = [str(self.files)]
        if not self.files:
            raise ValueError("data files list is empty; set data.train_files to one or more parquet files")
        if self.truncation not in TRUNCATION_MODES:
            raise ValueError(f"truncation={self.truncation!r} is not supported; choose one of {TRUNCATION_MODES}")
        if self.max_prompt_length < 1:
            raise ValueError(f"max_prompt_length={self.max_prompt_length} must be >= 1")


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


def row_problems(row: dict[str, Any], prompt_key: str = "prompt") -> list[str]:
    """What is wrong with one row of the verl schema (empty list when it is valid)."""
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
    reward_model = row.get("reward_model")
    if reward_model is None:
        problems.append("missing field 'reward_model'")
    elif not isinstance(reward_model, dict):
        problems.append(f"reward_model must be a dict, got {type(reward_model).__name__}")
    elif reward_model.get("ground_truth") is None:
        problems.append("missing field 'reward_model.ground_truth'")
    elif not isinstance(reward_model["ground_truth"], (str, int, float, dict, list)) or isinstance(
            reward_model["ground_truth"], bool):
        problems.append(f"reward_model.ground_truth must be a string or number (or a dict/list such as Search-R1's "
                        f"{{'target': [...]}}), got {type(reward_model['ground_truth']).__name__}")
    extra_info = row.get("extra_info")
    if extra_info is not None and not isinstance(extra_info, dict):
        problems.append(f"extra_info must be a dict, got {type(extra_info).__name__}")
    return problems


def validate_rows(rows: list[dict[str, Any]], source: str, prompt_key: str = "prompt") -> None:
    """Raise DataValidationError naming every bad row (`source` row index: problem; ...)."""
    problems = []
    for i, row in enumerate(rows):
        found = row_problems(row, prompt_key)
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


def check_graders(rows: list[dict[str, Any]], where: str) -> None:
    """Raise ValueError naming every data_source of ``rows`` that has no grader in this process (register custom
    graders before calling), so an unknown source stops the run at data load, before Ray and the engines start."""
    from megatron_cpo.rewards.registry import missing_grader_message, missing_graders

    missing = missing_graders(row["data_source"] for row in rows)
    if missing:
        counts = ", ".join(f"{source}: {sum(row['data_source'] == source for row in rows)} rows" for source in missing)
        raise ValueError(missing_grader_message(missing, f"{where} ({counts})"))


def _ground_truth(value: Any) -> Any:
    """Scalars as text (verl's graders compare strings); structured truths (Search-R1's {'target': [...]},
    code tests as a dict) unchanged."""
    return value if isinstance(value, (dict, list)) else str(value)


class PromptDataset:
    """Validated, tokenized prompt records from one or more verl-schema parquet files.

    With ``check_graders`` (the default) every ``data_source`` must have a grader (``missing_graders``); turn it off
    only when one custom reward function grades every source."""

    def __init__(self, config: DatasetConfig, tokenizer):
        self.config = config
        rows, where = [], []
        for path in config.files:
            file_rows = read_parquet_rows(path)
            validate_rows(file_rows, str(path), config.prompt_key)
            rows += file_rows
            where += [f"{path} row {i}" for i in range(len(file_rows))]
        if config.check_graders:
            check_graders(rows, ", ".join(map(str, config.files)))
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
                ground_truth=_ground_truth(reward_model["ground_truth"]),
                extra_info=dict(row.get("extra_info") or {}),
                reward_model=reward_model,
            ))
        if not self.records and not self.num_filtered:
            raise ValueError(f"no rows in {config.files}; give data files with prompts in them")
        if not self.records:
            raise ValueError(f"no prompts left in {config.files} after filtering {self.num_filtered} overlong ones; "
                             f"raise data.max_prompt_length={config.max_prompt_length}")

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> PromptRecord:
        return self.records[index]

