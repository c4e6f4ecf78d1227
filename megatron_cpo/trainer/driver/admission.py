"""Admission: which prompts the rank-0 controller submits, and what becomes of those a batch did not use, as one
strategy class per rule; the controller asks it and branches on none of its settings (docs/async.md, "The admission
rule").

- `SynchronousAdmission` (`async_training.max_staleness` = 0): requests ahead by the observed keep rate
  (`prompts_to_request`); unused prompts are cancelled and go back to the data stream.
- `StalenessAdmission` (k > 0): admits while `held < (k + 1) * train_batch_size` (`admission_capacity`), so no trained
  sample is more than k weight versions old; unused prompts stay in flight for the next batch.
Both cap the prompts generating at once (`inflight_cap`); finished ones waiting to commit do not count.
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from megatron_cpo.rollout.generators import GroupGenerator
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.config import AsyncTrainingConfig
from megatron_cpo.trainer.driver.prompt_stream import PromptStream, StreamPosition

# Look-ahead: request enough prompts that the batch fills with about this probability (one-sided normal quantile).
FILL_PROBABILITY_Z = 1.28


@dataclass
class Request:
    """A submitted prompt: its place in request order (`seq`), where it came from in the data stream, the record."""
    seq: int
    position: StreamPosition
    record: Any


@dataclass
class OpenRequests:
    """Prompts submitted and not yet committed, in request order: `running` on the engines, or `finished` (scored)
    and waiting for an earlier one to commit. The synchronous admission starts each step with none; the staleness
    admission carries them from step to step. `first` is the first uncommitted seq, `issued` the next seq to hand
    out."""
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


class BatchProgress(Protocol):
    """What admission reads of the batch being filled (`GroupAccumulator`): groups kept so far, the next seq to
    commit, groups scored that a filter will drop (`dropping`), the kept / committed counts (`stats`), and the scored
    groups after the batch, waiting to commit (`leftover`)."""
    kept: list
    next_seq: int
    dropping: int
    stats: Any

    def leftover(self) -> dict[int, Any]: ...


def prompts_to_request(needed: int, keep_rate: float) -> int:
    """Uncommitted prompts to have in flight so that `needed` of them are kept with ~90% probability.

    The kept count of N prompts is about Binomial(N, keep_rate); this solves N p - z sqrt(N p (1 - p)) = needed
    for N (exactly `needed` when every group is kept). A shortfall costs a whole extra response latency, a
    surplus only the cancelled prompts' tokens, hence the margin."""
    if needed <= 0:
        return 0
    p = min(max(keep_rate, 0.02), 1.0)
    spread = FILL_PROBABILITY_Z * math.sqrt(p * (1.0 - p))
    root = (spread + math.sqrt(spread * spread + 4.0 * p * needed)) / (2.0 * p)
    return math.ceil(root * root - 1e-9)


@dataclass
class KeepRateHistory:
    """Groups kept / committed in earlier steps, halved every step so the estimate follows the policy as it learns.
    With no history the rate starts at 1 (request exactly what is needed) and is learnt within the first step."""
    kept: float = 0.0
    committed: float = 0.0
    decay: float = 0.5

    def rate(self, kept_now: int, committed_now: int) -> float:
        return (self.kept + kept_now + 1.0) / (self.committed + committed_now + 1.0)

    def update(self, kept: int, committed: int) -> None:
        self.kept = self.decay * self.kept + kept
        self.committed = self.decay * self.committed + committed


class Admission(ABC):
    """The rule the controller asks before each submission and at each hand-out. `inflight_cap`: prompts generating
    at once, at most."""

    def __init__(self, batch_size: int, inflight_cap: int) -> None:
        self.batch_size = batch_size
        self.inflight_cap = inflight_cap

    @abstractmethod
    def begin(self, carried: OpenRequests, policy_version: int | None) -> OpenRequests:
        """The open requests a collection starts from (`carried`: the last one's), at the engines' weight version."""

    @abstractmethod
    def admits(self, batch: BatchProgress, open_: OpenRequests) -> bool:
        """Whether one more prompt may be submitted now."""

    @abstractmethod
    def hand_out(self, batch: BatchProgress, policy_version: int | None) -> None:
        """The batch goes to the trainer (full or not); what it kept trains with `policy_version`."""

    @abstractmethod
    def release_unused(self, open_: OpenRequests, batch: BatchProgress, generator: GroupGenerator,
                       stream: PromptStream) -> tuple[OpenRequests, bool]:
        """What the batch did not use, after its hand-out: the open requests the controller keeps, and whether prompts
        went back to the data stream (then the data is not exhausted after all)."""

    @abstractmethod
    def request_seed_step(self, step: int) -> int:
        """The step that a request's sampling seed mixes in (rerun and resume sample identically)."""

    def buffer_metrics(self, open_: OpenRequests) -> dict[str, float]:
        """What waits for the next batches after a hand-out (none unless the strategy carries prompts over)."""
        return {}


class SynchronousAdmission(Admission):
    """Staleness 0: request ahead by the observed keep rate; unused prompts are cancelled at the hand-out and go back
    to the data stream, so every trained sample is sampled by the weights that train it."""

    def __init__(self, batch_size: int, inflight_cap: int) -> None:
        super().__init__(batch_size, inflight_cap)
        self.keep_history = KeepRateHistory()

    def begin(self, carried: OpenRequests, policy_version: int | None) -> OpenRequests:
        return OpenRequests()  # each step afresh

    def admits(self, batch: BatchProgress, open_: OpenRequests) -> bool:
        keep_rate = self.keep_history.rate(batch.stats.kept, batch.stats.committed)
        wanted = prompts_to_request(self.batch_size - len(batch.kept), keep_rate)
        return open_.issued - batch.next_seq < wanted

    def hand_out(self, batch: BatchProgress, policy_version: int | None) -> None:
        self.keep_history.update(batch.stats.kept, batch.stats.committed)

    def release_unused(self, open_: OpenRequests, batch: BatchProgress, generator: GroupGenerator,
                       stream: PromptStream) -> tuple[OpenRequests, bool]:
        if open_.running:
            generator.cancel_all()
        rewound = batch.next_seq < open_.issued
        if rewound:
            stream.rewind(open_.by_seq[batch.next_seq].position)
        return OpenRequests(), rewound

    def request_seed_step(self, step: int) -> int:
        return step


class StalenessAdmission(Admission):
    """At most k weight versions between a prompt's admission and the update that trains it; unused prompts stay
    in flight. `unpushed`: kept prompts of the last batch whose weights the engines do not serve yet."""

    def __init__(self, max_staleness: int, batch_size: int, inflight_cap: int) -> None:
        super().__init__(batch_size, inflight_cap)
        self.max_staleness = max_staleness
        self.unpushed = 0
        self._handed_out: tuple[int, int | None] = (0, None)  # (prompts, weight version) of the last batch

    def begin(self, carried: OpenRequests, policy_version: int | None) -> OpenRequests:
        prompts, version = self._handed_out
        self.unpushed = prompts if policy_version is not None and policy_version == version else 0
        return carried

    def admits(self, batch: BatchProgress, open_: OpenRequests) -> bool:
        held = self.unpushed + len(batch.kept) + (open_.issued - batch.next_seq) - batch.dropping
        return admission_capacity(self.max_staleness, self.batch_size, held) > 0

    def hand_out(self, batch: BatchProgress, policy_version: int | None) -> None:
        self._handed_out = (len(batch.kept), policy_version)
        self.unpushed = 0  # the batch's own groups count as kept from now on (the next batches are admitted)

    def release_unused(self, open_: OpenRequests, batch: BatchProgress, generator: GroupGenerator,
                       stream: PromptStream) -> tuple[OpenRequests, bool]:
        open_.commit_up_to(batch.next_seq, batch.leftover())
        return open_, False

    def request_seed_step(self, step: int) -> int:
        """0 when k > 0: which step submits a prompt depends on how fast earlier groups finished (and were dropped),
        and a prompt's samples must not."""
        return step if self.max_staleness == 0 else 0

    def buffer_metrics(self, open_: OpenRequests) -> dict[str, float]:
        return {"async/buffered_groups": float(len(open_.finished)), "async/in_flight": float(len(open_.running))}


def admission_capacity(max_staleness: int, batch_size: int, held: int) -> int:
    """Prompts that may still be submitted: (k + 1) * B - held (docs/async.md, "The admission rule")."""
    return (max_staleness + 1) * batch_size - held


def admission_for(async_training: AsyncTrainingConfig, batch_size: int, max_inflight_prompts: int = 0
                  ) -> Admission:
    """The admission of `async_training.max_staleness` for batches of `batch_size` prompts;
    `max_inflight_prompts` (`rollout.max_inflight_prompts`, 0: twice the batch, or the k + 1 batches the bound may
    hold) caps the prompts generating at once."""
    k = async_training.max_staleness
    cap = max_inflight_prompts or max(2, k + 1) * batch_size
    return StalenessAdmission(k, batch_size, cap) if k > 0 else SynchronousAdmission(batch_size, cap)


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


def staleness_metrics(versions: RaggedRows, trainer_version: int, sampled: RaggedRows | None = None
                      ) -> dict[str, float]:
    """Of the trained samples (a multi-turn episode is one sample), given the weight version of each response token
    and which tokens were sampled (`sampled`, the loss mask: 0 on observations, None: all were):

    - per sample: staleness = trainer version minus the oldest version of its tokens (`async/staleness_mean`,
      `_max`), the fraction generated across a push (tokens of two or more versions, `async/partial_rollout_frac`)
      and the pushes each spanned (newest minus oldest version, `async/pushes_spanned_mean`, `_max`: an episode
      whose turns ran under several versions);
    - per sampled token: `async/token_staleness_mean` (what the off-policy correction weighs, token by token).
    Observation tokens carry the version of the sampled token before them (envs/episode.py), so they change no
    sample's oldest or newest version."""
    lengths = versions.lengths()
    rows = torch.arange(versions.rows).repeat_interleave(lengths)
    values = versions.values.double()
    fill = torch.full((versions.rows,), float(trainer_version), dtype=torch.float64)
    oldest = fill.scatter_reduce(0, rows, values, "amin", include_self=False)
    newest = fill.scatter_reduce(0, rows, values, "amax", include_self=False)
    staleness, spanned = trainer_version - oldest, newest - oldest
    weights = torch.ones_like(values) if sampled is None else sampled.values.double()
    token_staleness = ((trainer_version - values) * weights).sum() / weights.sum().clamp(min=1.0)
    return {"async/staleness_mean": float(staleness.mean()), "async/staleness_max": float(staleness.max()),
            "async/partial_rollout_frac": float((spanned > 0).double().mean()),
            "async/pushes_spanned_mean": float(spanned.mean()), "async/pushes_spanned_max": float(spanned.max()),
            "async/token_staleness_mean": float(token_staleness)}
