"""Shaping, the end of step 4 (docs/architecture.md, "One RL step"): the one place that turns the estimator's
advantages into the advantages the actor trains on.

`ResponseShaping` applies its terms (`SHAPING_TERMS`: the shaper, e.g. CPO's rule; slime's on-policy distillation,
`distillation.opd_kl_coef`; then the filters' loss scale) to whole responses: on the whole batch before the update,
or per micro-batch inside an on-policy update. Its metrics are always of the whole batch's `ShapedAdvantages`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, fields, replace

import torch

from megatron_cpo.algorithms.config import AlgorithmConfig
from megatron_cpo.algorithms.cpo import ShapingInputs
from megatron_cpo.algorithms.distillation import additive_advantages
from megatron_cpo.algorithms.filters import filter_loss_scale, scale_advantages
from megatron_cpo.algorithms.shapers import ADVANTAGE_SHAPERS, AdvantageShaper
from megatron_cpo.kernels import HintSignals, hint_mi_signals
from megatron_cpo.rollout.teacher_config import DistillationConfig
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.workers.distillation_step import TeacherSignal


@dataclass(frozen=True)
class ShapingSources:
    """What the terms are built from: the step batch, CPO's hinted log-probs (step 3; None: none scored), and the
    algorithm's and the actor's sections."""
    batch: StepBatch
    hint_log_probs: torch.Tensor | None
    algorithm: AlgorithmConfig
    actor: ActorConfig
    teacher: TeacherSignal | None = None  # distillation's teacher signal (step 3)
    distillation: DistillationConfig | None = None  # `distillation` when enabled


@dataclass(frozen=True)
class ScoredTokens:
    """The tokens of some whole responses: their mask and, when the actor scored them, its log-probs and entropy
    ([rows, R] each, without gradient)."""
    mask: torch.Tensor
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None


@dataclass(frozen=True)
class ShapedAdvantages:
    """What the shaping made of some whole responses' advantages: `steps[0]` the estimator's, then each term's result
    in order (the last, `advantages`, is what the actor trains on), and per term what it recorded for its metrics
    (per-token tensors [rows, R]; empty: nothing)."""
    steps: tuple[torch.Tensor, ...]
    records: tuple[tuple[torch.Tensor, ...], ...]

    @property
    def advantages(self) -> torch.Tensor:
        return self.steps[-1]


@dataclass(frozen=True)
class ShapingTerm(ABC):
    """One change to the advantages of whole responses. Its tensor fields hold one row per response of the batch
    (`map_rows` takes some rows of them, or moves them); `apply` works on the rows it holds; `metrics` reads the
    whole batch's. A new term (e.g. on-policy distillation's per-token reward `-coef * (student - teacher log-prob)`,
    added to the advantages or replacing them) is a subclass registered in `SHAPING_TERMS`, and what it is built from
    a field of `ShapingSources`."""

    @classmethod
    @abstractmethod
    def of_step(cls, sources: ShapingSources) -> ShapingTerm | None:
        """The term for this step's batch and settings; None when it does not apply."""

    @property
    def record_width(self) -> int:
        """How many per-token tensors `apply` records for `metrics`."""
        return 0

    @property
    def reads_log_probs(self) -> bool:
        """Whether `apply` reads the actor's log-probs or entropy (an on-policy update then shapes inside itself)."""
        return False

    @abstractmethod
    def apply(self, advantages: torch.Tensor, tokens: ScoredTokens
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        """The advantages after this term, [rows, R], and its `record_width` per-token records."""

    def metrics(self, before: torch.Tensor, after: torch.Tensor, tokens: ScoredTokens,
                record: tuple[torch.Tensor, ...]) -> dict[str, float]:
        """The step's metrics of this term, from the whole batch's advantages before and after it."""
        return {}

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ShapingTerm:
        """This term with `fn` applied to each of its per-response tensors (rows first)."""
        rows = {f.name: fn(value) for f in fields(self) if isinstance(value := getattr(self, f.name), torch.Tensor)}
        return replace(self, **rows)


@dataclass(frozen=True)
class ShaperTerm(ShapingTerm):
    """The shaper `algorithm.adv_estimator` selects (CPO's rule), with what it reads per response: correctness, the
    prompt's difficulty, whether the response was scored under a hint (`hinted`) and those log-probs
    (`hint_log_probs`, 0 on the other rows, whose plain log-probs stand in for them). Records the hint signals."""
    shaper: AdvantageShaper
    correct: torch.Tensor
    difficulty: torch.Tensor
    hinted: torch.Tensor
    hint_log_probs: torch.Tensor | None

    @classmethod
    def of_step(cls, sources: ShapingSources) -> ShaperTerm | None:
        algorithm, batch = sources.algorithm, sources.batch
        if algorithm.adv_estimator not in ADVANTAGE_SHAPERS:
            return None
        shaper = algorithm.shaper
        responses = shaper.response_inputs(batch.acc > 0, batch.group)
        hinted = (batch.has_hint if batch.hint_prompt_ids is not None
                  else torch.zeros(batch.response_ids.rows, dtype=torch.bool))
        return cls(shaper, responses.correct, responses.difficulty, hinted, sources.hint_log_probs)

    @property
    def record_width(self) -> int:  # HintSignals' five fields, the per-response ones broadcast over the tokens
        return len(HintSignals._fields) if self.shaper.needs_hint_contexts else 0

    @property
    def reads_log_probs(self) -> bool:
        return self.shaper.needs_log_probs

    def apply(self, advantages: torch.Tensor, tokens: ScoredTokens
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        hint_log_probs = signals = None
        if self.shaper.needs_hint_contexts:
            hint_log_probs = (tokens.log_probs if self.hint_log_probs is None
                              else torch.where(self.hinted[:, None], self.hint_log_probs, tokens.log_probs))
            signals = hint_mi_signals(tokens.log_probs, hint_log_probs, tokens.entropy, tokens.mask)
        shaped = self.shaper.shape(self._inputs(advantages, tokens, hint_log_probs, signals))
        if signals is None:
            return shaped, ()
        return shaped, tuple(value if value.dim() == 2 else value[:, None].expand_as(advantages) for value in signals)

    def metrics(self, before: torch.Tensor, after: torch.Tensor, tokens: ScoredTokens,
                record: tuple[torch.Tensor, ...]) -> dict[str, float]:
        signals = (HintSignals(*(value if name in ("mi", "kl", "u") else value[:, 0]
                                 for name, value in zip(HintSignals._fields, record))) if record else None)
        return self.shaper.metrics(self._inputs(before, tokens, None, signals), after, self.hinted)

    def _inputs(self, advantages: torch.Tensor, tokens: ScoredTokens, hint_log_probs: torch.Tensor | None,
                signals: HintSignals | None) -> ShapingInputs:
        return ShapingInputs(advantages, tokens.mask, tokens.log_probs, tokens.entropy, hint_log_probs, signals,
                             self.correct, self.difficulty)


@dataclass(frozen=True)
class LossScaleTerm(ShapingTerm):
    """The filters' loss scale: the advantages times `actor.filter_loss_scaling` of the share of prompt groups the
    filters kept (`kept_ratio`)."""
    kept_ratio: float
    mode: str

    @classmethod
    def of_step(cls, sources: ShapingSources) -> LossScaleTerm:
        return cls(sources.batch.kept_ratio, sources.actor.filter_loss_scaling)

    def apply(self, advantages: torch.Tensor, tokens: ScoredTokens
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        return scale_advantages(advantages, self.kept_ratio, self.mode), ()

    def metrics(self, before: torch.Tensor, after: torch.Tensor, tokens: ScoredTokens,
                record: tuple[torch.Tensor, ...]) -> dict[str, float]:
        return {"filter/loss_scale": filter_loss_scale(self.kept_ratio, self.mode)}


@dataclass(frozen=True)
class DistillationTerm(ShapingTerm):
    """slime's on-policy distillation (`distillation.opd_kl_coef` > 0): the advantages minus `coef` x (old - teacher
    log-prob) per token (algorithms/distillation.py `additive_advantages`); a row without a teacher (the self
    teacher's rows without a gold solution) is left as it is. Records the per-token reverse KL."""
    coef: float
    teacher_log_probs: torch.Tensor
    has_teacher: torch.Tensor

    @classmethod
    def of_step(cls, sources: ShapingSources) -> DistillationTerm | None:
        distillation, teacher = sources.distillation, sources.teacher
        if distillation is None or not distillation.uses_additive_form or teacher is None:
            return None
        return cls(distillation.opd_kl_coef, teacher.log_probs, teacher.rows)

    @property
    def reads_log_probs(self) -> bool:
        return True

    def apply(self, advantages: torch.Tensor, tokens: ScoredTokens
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        teacher = torch.where(self.has_teacher[:, None], self.teacher_log_probs, tokens.log_probs)
        shaped, _ = additive_advantages(advantages, tokens.log_probs, teacher, tokens.mask, self.coef)
        return shaped, ()

    def metrics(self, before: torch.Tensor, after: torch.Tensor, tokens: ScoredTokens,
                record: tuple[torch.Tensor, ...]) -> dict[str, float]:
        teacher = torch.where(self.has_teacher[:, None], self.teacher_log_probs, tokens.log_probs)
        return additive_advantages(before, tokens.log_probs, teacher, tokens.mask, self.coef)[1]


SHAPING_TERMS: tuple[type[ShapingTerm], ...] = (ShaperTerm, DistillationTerm, LossScaleTerm)
"""The shaping's terms, in the order they apply; each one decides from the step whether it applies."""


@dataclass(frozen=True)
class ResponseShaping:
    """The step's shaping: its terms in order, each holding its per-response inputs (all rows of the step batch, or
    one micro-batch's)."""
    terms: tuple[ShapingTerm, ...]

    @classmethod
    def of_step(cls, sources: ShapingSources) -> ResponseShaping:
        terms = (term.of_step(sources) for term in SHAPING_TERMS)
        return cls(tuple(term for term in terms if term is not None))

    @property
    def reads_log_probs(self) -> bool:
        return any(term.reads_log_probs for term in self.terms)

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ResponseShaping:
        """The same shaping with `fn` applied to every per-response tensor (take a micro-batch's rows, move them)."""
        return ResponseShaping(tuple(term.map_rows(fn) for term in self.terms))

    def shape(self, advantages: torch.Tensor, tokens: ScoredTokens) -> ShapedAdvantages:
        """The estimator's `advantages` [rows, R] of the rows this shaping holds, through every term."""
        steps, records = [advantages], []
        for term in self.terms:
            shaped, record = term.apply(steps[-1], tokens)
            steps.append(shaped)
            records.append(record)
        return ShapedAdvantages(tuple(steps), tuple(records))

    def metrics(self, shaped: ShapedAdvantages, tokens: ScoredTokens) -> dict[str, float]:
        """Every term's metrics over the whole batch."""
        metrics: dict[str, float] = {}
        for index, term in enumerate(self.terms):
            metrics.update(term.metrics(shaped.steps[index], shaped.steps[index + 1], tokens, shaped.records[index]))
        return metrics

    @property
    def column_count(self) -> int:
        """How many per-token tensors `columns` gives: the update gathers them over its micro-batches and ranks."""
        return len(self.terms) + sum(term.record_width for term in self.terms)

    def columns(self, shaped: ShapedAdvantages) -> tuple[torch.Tensor, ...]:
        """`shaped` as per-token tensors [rows, R] (each term's result, then its records), the estimator's left out."""
        return (*shaped.steps[1:], *(value for record in shaped.records for value in record))

    def from_columns(self, advantages: torch.Tensor, columns: tuple[torch.Tensor, ...]) -> ShapedAdvantages:
        """The `ShapedAdvantages` of the estimator's `advantages` whose `columns` an update gathered."""
        steps, rest = columns[:len(self.terms)], columns[len(self.terms):]
        records = []
        for term in self.terms:
            records.append(tuple(rest[:term.record_width]))
            rest = rest[term.record_width:]
        return ShapedAdvantages((advantages, *steps), tuple(records))
