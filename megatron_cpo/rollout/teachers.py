"""A distillation teacher: a source of per-token log-probs of the student's sampled tokens (and, for the top-k losses,
of the teacher's own k most likely ids), behind one small interface.

Three implementations: teacher engines (engine_teacher.py: vLLM engines scoring `prompt + response` with prompt
log-probs, spawned of their own size and count or reached as `megatron-cpo rollout` servers), a frozen Megatron model
in the trainer (trainer/workers/megatron_teacher.py, in the actor's layout), and the policy itself with the gold
solution in its context (the same module, on the actor's weights). Every teacher scores at temperature 1 whatever
the rollout's temperature (verl forces it too). Several teachers are routed by a per-row key (`TeacherRouter`).

A non-finite teacher log-prob is refused where it enters (`TeacherScores.check_finite`), naming the response.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


class TeacherScoreError(RuntimeError):
    """A teacher returned something the loss cannot use (a non-finite log-prob); the message names the response."""


@dataclass(frozen=True)
class TeacherScores:
    """A teacher's view of N responses, response-aligned: `log_probs` [N, R] float32, each sampled token's log-prob
    (0 past a response's end); with top-k, `topk_ids` [N, R, k] int64 and `topk_log_probs` [N, R, k] float32, the
    teacher's k most likely ids at each position, best first (0 past the end)."""
    log_probs: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[list[float], list[list[int]] | None, list[list[float]] | None]],
                  width: int, topk: int) -> TeacherScores:
        """Pad per-response lists (log-probs, top-k ids, top-k log-probs) to [N, width(, k)]."""
        log_probs = torch.zeros(len(rows), width)
        ids = torch.zeros(len(rows), width, topk, dtype=torch.int64) if topk else None
        top = torch.zeros(len(rows), width, topk) if topk else None
        for i, (row_log_probs, row_ids, row_top) in enumerate(rows):
            length = min(len(row_log_probs), width)
            log_probs[i, :length] = torch.tensor(row_log_probs[:length], dtype=torch.float32)
            if topk and length:
                ids[i, :length] = torch.tensor(row_ids[:length], dtype=torch.int64)
                top[i, :length] = torch.tensor(row_top[:length], dtype=torch.float32)
        return cls(log_probs, ids, top)

    @classmethod
    def cat(cls, parts: Sequence[TeacherScores]) -> TeacherScores:
        """Rows of several scores (same width and k) one after the other."""
        def joined(name: str) -> torch.Tensor | None:
            tensors = [getattr(part, name) for part in parts]
            return None if tensors[0] is None else torch.cat(tensors)

        return cls(joined("log_probs"), joined("topk_ids"), joined("topk_log_probs"))

    def select(self, rows: torch.Tensor) -> TeacherScores:
        def picked(tensor: torch.Tensor | None) -> torch.Tensor | None:
            return None if tensor is None else tensor[rows]

        return TeacherScores(self.log_probs[rows], picked(self.topk_ids), picked(self.topk_log_probs))

    def check_finite(self, lengths: Sequence[int], names: Sequence[str], teacher: str) -> None:
        """Raise `TeacherScoreError` naming the first response (`names[i]`) whose log-probs within its `lengths[i]`
        tokens are not finite."""
        width = self.log_probs.shape[1]
        valid = torch.arange(width)[None, :] < torch.tensor(list(lengths))[:, None]
        for values in (self.log_probs, self.topk_log_probs):
            if values is None:
                continue
            bad = ~torch.isfinite(values) & (valid if values.dim() == 2 else valid[..., None])
            if bool(bad.any()):
                row, position = (int(i) for i in bad.nonzero()[0][:2])
                raise TeacherScoreError(
                    f"teacher {teacher!r} gave a non-finite log-prob ({float(values[bad][0])}) to "
                    f"token {position} of response {names[row]!r}; a teacher log-prob must be finite (check the "
                    "teacher's weights and dtype)")


class Teacher(Protocol):
    """What the distillation loss reads of a teacher: the log-probs of each sampled response token given its prompt
    and the response before it, at temperature 1, and with `topk` > 0 the teacher's top-k at each position."""

    topk: int

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TeacherScores:
        """The scores of each response after its prompt (token ids as sampled), [len(responses), max length]."""

    def shutdown(self) -> None:
        """Release what the teacher holds (engines it started); safe to call twice."""


class TeacherRouter:
    """Several teachers, each scoring the rows whose routing value (the row's `distillation.teacher_key` column) is
    its key; a lone teacher keyed `default` scores every row."""

    def __init__(self, teachers: dict[str, Teacher], default_key: str = "default") -> None:
        self.teachers = teachers
        self.default_key = default_key

    def teacher_of(self, key: str) -> Teacher:
        teacher = self.teachers.get(key, self.teachers.get(self.default_key))
        if teacher is None:
            raise KeyError(f"no teacher scores rows whose teacher key is {key!r} (teachers: {sorted(self.teachers)}); "
                           "add one to distillation.teacher_models")
        return teacher

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], keys: Sequence[str],
              width: int) -> TeacherScores:
        """Each row scored by its key's teacher, back in row order, [N, width(, k)]."""
        rows_of: dict[int, list[int]] = {}
        for row, key in enumerate(keys):
            rows_of.setdefault(id(self.teacher_of(key)), []).append(row)
        teachers = {id(self.teacher_of(key)): self.teacher_of(key) for key in keys}
        topk = {teacher.topk for teacher in teachers.values()}
        if len(topk) > 1:
            raise ValueError(f"the teachers return different top-k ({sorted(topk)}); one loss reads them all")
        k = topk.pop() if topk else 0
        out = TeacherScores(torch.zeros(len(keys), width), torch.zeros(len(keys), width, k, dtype=torch.int64)
                            if k else None, torch.zeros(len(keys), width, k) if k else None)
        for ident, rows in rows_of.items():
            scores = teachers[ident].score([prompts[r] for r in rows], [responses[r] for r in rows])
            length = min(width, scores.log_probs.shape[1])
            index = torch.tensor(rows)
            out.log_probs[index, :length] = scores.log_probs[:, :length]
            if k:
                out.topk_ids[index, :length] = scores.topk_ids[:, :length]
                out.topk_log_probs[index, :length] = scores.topk_log_probs[:, :length]
        return out

    def shutdown(self) -> None:
        for teacher in self.teachers.values():
            teacher.shutdown()
