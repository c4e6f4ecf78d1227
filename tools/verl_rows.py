"""Rows already in verl's schema (built by verl's examples/data_preprocess scripts or by this tool): recognise them,
validate them and pass them through, and attach worked solutions from a raw release to them.

verl's GSM8K rows keep the worked answer in `extra_info.answer`; its MATH rows keep no solution at all, so CPO would
show the bare answer as its hint. `attach_solutions` reads the raw release with the same converters as
`prepare_data.py --kind <kind>`, matches each verl row to its raw record by the question text (`extra_info.question`,
else the user prompt, which verl builds as the question followed by an instruction) and stores the gold solution in
`extra_info.solution`, where CPO's hint reader looks first.
"""
from __future__ import annotations

from typing import Any

from data_sources import SOURCES, RecordError

from megatron_cpo.data.dataset import row_problems

VERL_FIELDS = ("data_source", "prompt", "reward_model")
_PREFIX_CHARS = 40


def is_verl_row(record: Any) -> bool:
    """A record that already has verl's top-level fields (whatever their contents)."""
    return isinstance(record, dict) and all(name in record for name in VERL_FIELDS)


def pass_through(record: dict[str, Any]) -> dict[str, Any]:
    """The record unchanged (all its columns kept) when it is a valid verl row; RecordError naming what is wrong."""
    problems = row_problems(record)
    if problems:
        raise RecordError("; ".join(problems))
    return {**record, "extra_info": dict(record.get("extra_info") or {})}


def _key(text: Any) -> str:
    return " ".join(str(text).split())


class SolutionIndex:
    """Gold solutions of a raw release, looked up by question text (whitespace-insensitive; a row's prompt may
    continue after the question). Questions are indexed by their first 40 characters (all of a shorter one), so a
    lookup costs one dict probe per distinct short-question length."""

    def __init__(self, records: list[tuple[str, Any]], kind: str) -> None:
        self.by_question: dict[str, str] = {}
        self.by_prefix: dict[str, list[str]] = {}
        self.prefix_lengths: set[int] = set()
        self.problems: list[str] = []
        for where, record in records:
            try:
                if isinstance(record, RecordError):
                    raise record
                if not isinstance(record, dict):
                    raise RecordError(f"record must be an object with named fields, got {type(record).__name__}")
                converted = SOURCES[kind].convert(record)
            except RecordError as error:
                self.problems.append(f"{where}: {error}")
                continue
            if converted.solution:
                question = _key(converted.question)
                self.by_question[question] = converted.solution
                self.by_prefix.setdefault(question[:_PREFIX_CHARS], []).append(question)
                self.prefix_lengths.add(min(len(question), _PREFIX_CHARS))

    def find(self, row: dict[str, Any]) -> str | None:
        """The solution whose question is the row's `extra_info.question`, else the longest one that starts the
        row's last user message; None when none matches."""
        question = (row.get("extra_info") or {}).get("question")
        if question is not None and _key(question) in self.by_question:
            return self.by_question[_key(question)]
        users = [m.get("content", "") for m in row.get("prompt") or []
                 if isinstance(m, dict) and m.get("role") == "user"]
        if not users:
            return None
        content = _key(users[-1])
        matches = [question for length in self.prefix_lengths for question in self.by_prefix.get(content[:length], [])
                   if content.startswith(question)]
        return self.by_question[max(matches, key=len)] if matches else None


def attach_solutions(rows: list[dict[str, Any]], index: SolutionIndex, overwrite: bool = False) -> list[int]:
    """Set `extra_info.solution` of each row from `index` (kept when present unless `overwrite`); returns the
    positions of the rows that found no solution."""
    unmatched = []
    for position, row in enumerate(rows):
        extra_info = row.setdefault("extra_info", {})
        if extra_info.get("solution") and not overwrite:
            continue
        solution = index.find(row)
        if solution is None:
            unmatched.append(position)
        else:
            extra_info["solution"] = solution
    return unmatched
