"""`async_training.*`: asynchronous training with bounded staleness, and the admission rule that bounds it.

With `max_staleness` k > 0 the engines keep generating while the trainer updates (docs/async.md): prompts not used
by a step stay in flight for the next one, and the controller submits the next steps' prompts before it hands a batch
to the trainer. What bounds how old a trained sample can be is admission, not dropping old samples (dropping would
bias the data towards short answers): a prompt is submitted only while

    held = (kept groups of the batch being filled, or handed to the trainer and not yet pushed)
           + (prompts submitted and not yet committed: generating, or finished and waiting for an earlier one)
    held < (k + 1) * train_batch_size.

This is AReaL's `(k + v + 1) * B - (accepted + running)` at weight version v, counted from the live prompts instead
of totals (the same when every batch is full, and still exact when one is partial). Why it bounds staleness: groups
commit in request order, so a prompt submitted with `held` prompts ahead of it that may still be trained lands at
most (k + 1) batches from now, counting the batch that is waiting for its push; it is trained at most k weight
versions after the one it started on, and every token it has is at least that new. A group a filter drops
(filter-groups, RAGEN) leaves `held` when it is judged and frees its slot; filter-groups judges each group on its
own, so a group it will drop leaves as soon as it is scored, before the groups ahead of it commit. With k = 0 the
rule would admit one batch at a time; the synchronous loop does better (it may request ahead, then cancels what it
did not use), so k = 0 keeps it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from megatron_cpo.trainer.driver.prompt_stream import StreamPosition


def admission_capacity(max_staleness: int, batch_size: int, held: int) -> int:
    """Prompts that may still be submitted: (k + 1) * B - held (see the module docstring)."""
    return (max_staleness + 1) * batch_size - held


@dataclass
class Request:
    """A submitted prompt: its place in request order (`seq`), where it came from in the data stream, the record."""
    seq: int
    position: StreamPosition
    record: Any


@dataclass
class OpenRequests:
    """Prompts submitted and not yet committed, in request order: `running` on the engines, or `finished` (scored)
    and waiting for an earlier one to commit. The synchronous loop starts each step with none; with asynchronous
    training the controller carries them from step to step. `first` is the first uncommitted seq, `issued` the next
    seq to hand out."""
    by_seq: dict[int, Request] = field(default_factory=dict)
    running: dict[str, Request] = field(default_factory=dict)
    finished: dict[int, Any] = field(default_factory=dict)
    first: int = 0
    issued: int = 0

    def add(self, request_id: str, request: Request) -> None:
        self.by_seq[request.seq] = request
        self.running[request_id] = request
        self.issued = request.seq + 1

    def commit_up_to(self, seq: int, finished: dict[int, Any]) -> None:
        """Everything before `seq` was committed; `finished`: the scored groups after it, still waiting."""
        for done in range(self.first, seq):
            self.by_seq.pop(done, None)
        self.first, self.finished = seq, finished

    def first_position(self) -> StreamPosition | None:
        """Where the first uncommitted prompt is in the data stream (None when every prompt is committed)."""
        return self.by_seq[self.first].position if self.first < self.issued else None


@dataclass
class EngineIdleWatch:
    """How long the engines had nothing to generate between a batch's hand-off to the trainer and the next
    collection: from the hand-off, or from when the last group then still generating finished (the engines' own
    clock, `RolloutGroup.finished_at`). Counts the whole fleet as idle only when every engine is; a group not seen
    finished by the next collection counts as generating throughout."""
    handed_out_at: float | None = None
    generating: set[str] = field(default_factory=set)
    last_finish: float = 0.0

    def hand_out(self, now: float, running: Iterable[str]) -> None:
        self.handed_out_at, self.generating, self.last_finish = now, set(running), now

    def finished(self, request_id: str, finished_at: float | None) -> None:
        if request_id in self.generating:
            self.generating.discard(request_id)
            self.last_finish = max(self.last_finish, finished_at if finished_at is not None else time.time())

    def idle_until(self, now: float) -> float | None:
        """Seconds the engines were idle between the last hand-off and `now` (None before the first hand-off)."""
        if self.handed_out_at is None:
            return None
        return 0.0 if self.generating else max(0.0, now - self.last_finish)


def staleness_metrics(versions: list[list[int]], trainer_version: int) -> dict[str, float]:
    """Of the trained samples (each given by its tokens' weight versions): staleness = trainer version minus the
    oldest version of the sample's tokens, its mean and max, and the fraction of samples whose tokens span more than
    one version (generated across a push)."""
    oldest = torch.tensor([min(v) if v else trainer_version for v in versions], dtype=torch.float64)
    spans = torch.tensor([len(set(v)) > 1 for v in versions], dtype=torch.float64)
    staleness = trainer_version - oldest
    return {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
            "async/partial_rollout_frac": float(spans.mean())}
