"""Rank 0's engine teachers of on-policy distillation (docs/distillation.md): every finished group goes to its
teacher's engines as the generator hands it over, overlapping the other rollouts, and the step batch's groups are
collected when the batch is built (`distillation/teacher_seconds`: the wait).

A group's teacher is the one whose routing key is the row's `distillation.teacher_key` value (a `PromptRecord`
field such as `data_source`, else an `extra_info` entry), or the lone default teacher. A group that is scored but
not trained (filtered, or past the batch) is collected and dropped at the next batch; a kept group that was never
submitted (validation took it from the engines, or it was dropped before being kept) is submitted then.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.rollout.engine_teacher import EngineTeacher, start_engine_teacher
from megatron_cpo.rollout.generators import GroupGenerator
from megatron_cpo.rollout.teacher_config import DEFAULT_KEY, DistillationConfig
from megatron_cpo.rollout.teachers import TeacherScoreError, TeacherScores
from megatron_cpo.rollout.types import RolloutEnginesLostError, RolloutGroup, SamplingParams
from megatron_cpo.trainer.driver.accumulator import ScoredGroup

COLLECT_TIMEOUT_S = 600.0  # without progress: a teacher engine that answers nothing for this long is stuck


@dataclass(frozen=True)
class TeacherBatch:
    """The teachers' scores of a step batch's rows in row order, [N, longest response(, k)], and the seconds the
    driver waited for them."""
    scores: TeacherScores
    seconds: float


def routing_value(record: Any, teacher_key: str) -> str:
    """A row's `distillation.teacher_key` value: the record's field of that name, else its `extra_info` entry."""
    value = getattr(record, teacher_key, None)
    if value is None:
        value = getattr(record, "extra_info", {}).get(teacher_key)
    return str(value)


class TeacherFeed:
    """The engine teachers by routing key (`DistillationConfig.routing_key`), and the groups submitted to them."""

    def __init__(self, teachers: dict[str, EngineTeacher], teacher_key: str) -> None:
        self.teachers = teachers
        self.teacher_key = teacher_key
        self.submitted: dict[str, tuple[EngineTeacher, int]] = {}  # request id -> (teacher, batch count then)
        self.batches = 0
        topk = {teacher.topk for teacher in teachers.values()}
        if len(topk) != 1:
            raise ValueError(f"the engine teachers return different top-k ({sorted(topk)}); one loss reads them all")
        self.topk = topk.pop()

    def teacher_of(self, record: Any) -> EngineTeacher:
        key = routing_value(record, self.teacher_key)
        teacher = self.teachers.get(key, self.teachers.get(DEFAULT_KEY))
        if teacher is None:
            raise KeyError(f"no teacher scores rows whose distillation.teacher_key={self.teacher_key} is {key!r} "
                           f"(teachers' keys: {sorted(self.teachers)}); add one to distillation.teacher_models")
        return teacher

    def submit(self, request_id: str, record: Any, prompt: list[int], responses: list[list[int]]) -> None:
        teacher = self.teacher_of(record)
        teacher.submit(request_id, prompt, responses)
        self.submitted[request_id] = (teacher, self.batches)

    def watching(self, generator: GroupGenerator) -> ScoringGenerator:
        """`generator`, whose finished groups are submitted to their teachers as they come out."""
        return ScoringGenerator(generator, self)

    def collect(self, groups: list[ScoredGroup]) -> TeacherBatch:
        """The scores of a step batch's `groups` (each group's rows in order), [N, longest response(, k)]; a
        non-finite log-prob raises `TeacherScoreError` naming the response, and so does a teacher that fails (other
        than by losing every engine). The groups scored but not trained since the batch before are collected and
        dropped."""
        started = time.perf_counter()
        for group in groups:
            if group.request_id not in self.submitted:
                self.submit(group.request_id, group.record, group.prompt_token_ids, group.response_token_ids)
        wanted = {group.request_id for group in groups}
        stale = [rid for rid, (_, batch) in self.submitted.items() if rid not in wanted and batch < self.batches]
        by_teacher: dict[int, tuple[EngineTeacher, list[str]]] = {}
        for request_id in [*wanted, *stale]:
            teacher = self.submitted.pop(request_id)[0]
            by_teacher.setdefault(id(teacher), (teacher, []))[1].append(request_id)
        scores: dict[str, TeacherScores] = {}
        for teacher, ids in by_teacher.values():
            try:
                scores.update(teacher.collect(ids, timeout=COLLECT_TIMEOUT_S))
            except TeacherScoreError:
                raise
            except RolloutEnginesLostError as err:  # the rollout's engines are fine: this is the teacher's loss
                raise TeacherScoreError(f"teacher {teacher.name!r} lost every engine ({err}); resume with "
                                        "trainer.resume=auto once its engines can run (distillation.teacher_models."
                                        f"{teacher.name})") from err
            except Exception as err:  # any other failure of a teacher ends the step, named
                raise TeacherScoreError(f"teacher {teacher.name!r} failed to score {len(ids)} group(s) "
                                        f"({type(err).__name__}: {err}); check the teacher's engines or "
                                        "servers") from err
        self.batches += 1
        width = max((len(r) for group in groups for r in group.response_token_ids), default=0)
        rows = [_padded(scores[group.request_id], width) for group in groups]
        return TeacherBatch(TeacherScores.cat(rows), time.perf_counter() - started)

    def shutdown(self) -> None:
        for teacher in {id(t): t for t in self.teachers.values()}.values():
            teacher.shutdown()


def _padded(scores: TeacherScores, width: int) -> TeacherScores:
    """`scores` right-padded with 0 (or cut) to `width` response positions."""
    def pad(tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None:
            return None
        extra = width - tensor.shape[1]
        if extra <= 0:
            return tensor[:, :width]
        return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], extra, *tensor.shape[2:])], 1)

    return TeacherScores(pad(scores.log_probs), pad(scores.topk_ids), pad(scores.topk_log_probs))


ENGINE_KINDS = ("engines", "server")


def start_teacher_feed(distillation: DistillationConfig, given: dict[str, EngineTeacher] | None, dtype: str,
                       context: int, seed: int, ray_address: str, server_timeout_s: float) -> TeacherFeed | None:
    """The run's engine teachers (`kind: engines` or `server`) as a `TeacherFeed`: `given` by name (already
    running, e.g. shared by tests; left running), else started or reached here (after the rollout's engines, so a
    teacher's `RolloutManager` joins their Ray); None when no teacher is served by engines. `context`: prompt +
    response + 1 tokens; `dtype`: the actor's compute dtype, unless a teacher's `inference.dtype` says."""
    names = [name for name, teacher in distillation.teacher_models.items()
             if distillation.enabled and teacher.kind in ENGINE_KINDS]
    if not names:
        return None
    started: dict[str, EngineTeacher] = {}
    try:
        for name in names:
            started[name] = (given[name] if given is not None else
                             start_engine_teacher(name, distillation, dtype, context, seed, ray_address,
                                                  server_timeout_s))
    except BaseException:
        for teacher in started.values():
            teacher.shutdown()
        raise
    return TeacherFeed({distillation.routing_key(name): teacher for name, teacher in started.items()},
                       distillation.teacher_key)


class ScoringGenerator:
    """A `GroupGenerator` that submits each finished group of its own requests to the group's teacher before
    handing it over (groups it did not submit, such as validation's, pass through unscored)."""

    def __init__(self, generator: GroupGenerator, feed: TeacherFeed) -> None:
        self.generator = generator
        self.feed = feed
        self.records: dict[str, Any] = {}  # the records of requests not finished yet, by id

    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        self.records[request_id] = record
        self.generator.submit(request_id, record, params)

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        return self._scored(self.generator.finished(timeout=timeout))

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        for group in self.generator.completed(timeout=timeout):
            yield from self._scored([group])

    def cancel_all(self) -> int:
        self.records.clear()
        return self.generator.cancel_all()

    def _scored(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        for group in groups:
            record = self.records.pop(group.request_id, None)
            if record is not None:
                self.feed.submit(group.request_id, record, list(group.prompt_token_ids),
                                 [list(sample.token_ids) for sample in group.samples])
        return groups
