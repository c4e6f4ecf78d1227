"""On-policy distillation in the step (docs/distillation.md), as every rank runs it: the teacher's signal of the
step batch (step 3) and its term in the actor's loss (step 5); slime's additive form is a shaping term instead
(trainer/workers/shaping.py).

The signal comes from the engine teachers (their scores travel in the `StepBatch`, trainer/driver/teacher_feed.py)
or from a teacher in the trainer: a frozen Megatron model (`kind: megatron`) scoring the sequences as sampled, or
the policy itself (`kind: self`) scoring each response after its hint context (the prompt with the gold solution);
a row without a gold solution has no teacher and contributes no signal (D = 0: its teacher log-probs are the
student's own).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Protocol

import torch

from megatron_cpo.algorithms.distillation import DistillationInputs, TopKInputs, distillation_loss, total_loss
from megatron_cpo.algorithms.distillation_config import DistillationLossConfig
from megatron_cpo.kernels import linear_log_probs_and_entropy, linear_top_k, log_probs_and_entropy, logits_top_k
from megatron_cpo.models.builder import gather_sequence_parallel, lm_head_weight
from megatron_cpo.rollout.teachers import TeacherScores
from megatron_cpo.trainer.batch.context_parallel import chunk_index, gather_positions
from megatron_cpo.trainer.batch.packing import PackedRows
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, PackedSequences, pack_sequences
from megatron_cpo.trainer.batch.step_batch import StepBatch


class SequenceTeacher(Protocol):
    """What the step reads of a teacher in the trainer (trainer/workers/megatron_teacher.py's `MegatronTeacher`): its
    top-k, and its scores of packed sequences on every rank."""

    topk: int

    def score_sequences(self, seqs: PackedSequences) -> TeacherScores:
        """The teacher's scores of every response of `seqs`, [rows, R(, k)]."""


@dataclass(frozen=True)
class TrainerTeacher:
    """A teacher that scores on every rank of the trainer: `model` (a frozen Megatron teacher, or the actor's own
    model for the self teacher) and whether it scores the responses after their hint contexts (`hinted`: self)."""
    model: SequenceTeacher
    hinted: bool


@dataclass(frozen=True)
class TeacherSignal:
    """The teacher's view of the step batch's responses, response-aligned: each sampled token's log-prob [N, R], the
    top-k ids and log-probs [N, R, k] (top-k modes; else None), and which rows have a teacher (`rows` [N] bool)."""
    log_probs: torch.Tensor
    rows: torch.Tensor
    topk_ids: torch.Tensor | None = None
    topk_log_probs: torch.Tensor | None = None

    def map_rows(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> TeacherSignal:
        """This signal with `fn` applied to each tensor (rows first): a micro-batch's rows, a device."""
        return replace(self, **{f.name: fn(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})


def _fit(tensor: torch.Tensor | None, width: int) -> torch.Tensor | None:
    """`tensor` [N, R'(, k)] cut or right-padded with 0 to R = `width` response positions."""
    if tensor is None or tensor.shape[1] == width:
        return tensor
    if tensor.shape[1] > width:
        return tensor[:, :width]
    return torch.cat([tensor, tensor.new_zeros(tensor.shape[0], width - tensor.shape[1], *tensor.shape[2:])], 1)


def teacher_signal(batch: StepBatch, seqs: PackedSequences, teacher: TrainerTeacher | None, pad_token_id: int
                   ) -> TeacherSignal | None:
    """The step batch's teacher signal [N, R(, k)] (R: `seqs.response_width`): the engine teachers' scores the batch
    carries, or the trainer's teacher's (every rank together); None without distillation."""
    width, rows = seqs.response_width, batch.response_ids.rows
    if batch.teacher_log_probs is not None:
        return TeacherSignal(_fit(batch.teacher_log_probs, width), torch.ones(rows, dtype=torch.bool),
                             _fit(batch.teacher_topk_ids, width), _fit(batch.teacher_topk_log_probs, width))
    if teacher is None:
        return None
    if not teacher.hinted:
        return _signal(teacher.model.score_sequences(seqs), torch.ones(rows, dtype=torch.bool))
    has_hint = batch.has_hint if batch.has_hint is not None else torch.zeros(rows, dtype=torch.bool)
    topk = teacher.model.topk
    full = TeacherScores(torch.zeros(rows, width), torch.zeros(rows, width, topk, dtype=torch.long) if topk else None,
                         torch.zeros(rows, width, topk) if topk else None)
    if batch.hint_prompt_ids is not None:  # the rows with a gold solution, after their hint contexts
        hinted = has_hint.nonzero()[:, 0]
        scores = teacher.model.score_sequences(pack_sequences(batch.hint_prompt_ids, batch.response_ids.select(hinted),
                                                              pad_token_id, width))
        for name in ("log_probs", "topk_ids", "topk_log_probs"):
            if getattr(full, name) is not None:
                getattr(full, name)[hinted] = getattr(scores, name).to(getattr(full, name).dtype)
    return _signal(full, has_hint)


def _signal(scores: TeacherScores, rows: torch.Tensor) -> TeacherSignal:
    return TeacherSignal(scores.log_probs, rows, scores.topk_ids, scores.topk_log_probs)


def at_positions(layout: PackedSequences | PackedRows, values: torch.Tensor, fill: int) -> torch.Tensor:
    """Response-aligned `values` [rows, R, k] placed at the positions that predict each response token (the layout's
    `to_response` read backwards), `fill` elsewhere: [*layout.tokens_shape, k]."""
    shape = tuple(layout.tokens_shape)
    flat = torch.arange(1, math.prod(shape) + 1).reshape(shape)
    index = layout.to_response(flat) - 1  # [rows, R]: each response token's flat position; -1 off the mask
    valid = index >= 0
    out = torch.full((math.prod(shape), values.shape[-1]), fill, dtype=values.dtype)
    out[index[valid]] = values.to(out.device)[valid]
    return out.reshape(*shape, values.shape[-1])


@dataclass(frozen=True)
class StudentScorer:
    """The student's log-probs at other ids than the sampled ones, from the same forward (the last stage's `output`:
    logits, or with fused kernels the hidden states and the lm-head weight, never the logits), vocab-parallel over TP
    and gathered over CP as the sampled tokens' are: the top-k losses' log q at the teacher's ids."""
    model: Any
    fused: bool
    output: torch.Tensor
    layout: PackedSequences | PackedRows
    temperature: float
    cp_size: int
    cp_rank: int

    def __call__(self, teacher_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the student's log-probs at `teacher_ids`, its own top-k ids), both [rows, R, k] response-aligned."""
        from megatron.core import parallel_state

        tp_group = (parallel_state.get_tensor_model_parallel_group()
                    if parallel_state.get_tensor_model_parallel_world_size() > 1 else None)
        k, vocab = teacher_ids.shape[-1], self.model.hf_vocab_size
        ids = at_positions(self.layout, teacher_ids.long(), IGNORE_INDEX).to(self.output.device)
        if self.cp_size > 1:
            ids = ids[:, chunk_index(self.layout.length, self.cp_size, self.cp_rank).to(ids.device)]
        if self.fused:
            hidden = gather_sequence_parallel(self.model, self.output).transpose(0, 1)
            weight = lm_head_weight(self.model)
            log_probs = linear_log_probs_and_entropy(hidden, weight, ids, temperature=self.temperature,
                                                     tp_group=tp_group, ignore_index=IGNORE_INDEX,
                                                     vocab_size=vocab)[0]
            own = linear_top_k(hidden, weight, k, tp_group, vocab)
        else:
            log_probs = log_probs_and_entropy(self.output, ids, temperature=self.temperature, tp_group=tp_group,
                                              ignore_index=IGNORE_INDEX, vocab_size=vocab)[0]
            own = logits_top_k(self.output, k, tp_group, vocab)
        own = own.float()  # ids below 2^24 ride float32 exactly (the gather over CP is a float all-gather)
        if self.cp_size > 1:
            group = parallel_state.get_context_parallel_group()
            log_probs, own = (gather_positions(t, self.layout.length, group) for t in (log_probs, own))
        slices = [(self.layout.to_response(log_probs[..., i]), self.layout.to_response(own[..., i]))
                  for i in range(k)]
        return (torch.stack([lp for lp, _ in slices], -1),
                torch.stack([ids for _, ids in slices], -1).round().long())


def distillation_term(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor,
                      teacher: TeacherSignal, config: DistillationLossConfig, loss_agg_mode: str,
                      task_loss: torch.Tensor, global_tokens: float, global_seqs: float,
                      student: StudentScorer | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One micro-batch's loss with the distillation term (verl's `distillation_loss`, then `total_loss`: plus the
    task's `task_loss` with `use_task_rewards`, else the term alone) and verl's `actor/distillation/*` metrics.
    Rows without a teacher have no signal: D = 0 for the estimators (the teacher's log-probs are the student's own),
    and the top-k modes leave them out (`student` scores the teacher's ids there)."""
    rows = teacher.rows.to(mask.device)[:, None]
    teacher_log_probs = torch.where(rows, teacher.log_probs.to(log_probs.device), log_probs.detach())
    topk = None
    if config.rules.topk:
        at_ids, own = student(teacher.topk_ids)
        topk = TopKInputs(teacher.topk_ids.to(at_ids.device), teacher.topk_log_probs.to(at_ids.device), at_ids,
                          own.to(at_ids.device))
        mask = mask * rows
    inputs = DistillationInputs(log_probs, mask, teacher_log_probs, topk)
    term, metrics = distillation_loss(inputs, old_log_probs, config, loss_agg_mode, global_tokens=global_tokens,
                                      global_seqs=global_seqs)
    return total_loss(task_loss, term, config), metrics
