"""Distillation teachers in the trainer: a frozen Megatron model of its own checkpoint (`kind: megatron`, slime's
`--opd-type megatron`), and the policy itself with the gold solution in its context (`kind: self`).

Both score on every rank, in the actor's layout (Megatron's parallel state is one per process, so a teacher in the
trainer takes the actor's TP / PP / CP; its heads and layers must divide by them, trainer/run/distillation_preflight.py
checks it): the final hidden states and the vocab-parallel lm-head give each sampled token's log-prob at temperature
1 and, with top-k, the teacher's k best ids and their log-probs (kernels: `linear_top_k`, and
`linear_log_probs_and_entropy` at k ids), without the logits. The frozen teacher stays on the device, as the
reference does. The self teacher is the trainer's hinted pass: the actor's current weights scoring the hint contexts
(data/hints.py) that CPO builds, cheaper than the engines would be (no engine time taken from generation, the weights
exactly the policy's, also in asynchronous training where engines may lag) at one forward of the hinted sequences.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from megatron_cpo.kernels import linear_log_probs_and_entropy, linear_top_k
from megatron_cpo.models.builder import gather_sequence_parallel, lm_head_weight
from megatron_cpo.rollout.teacher_config import TeacherModelConfig
from megatron_cpo.rollout.teachers import TeacherScores
from megatron_cpo.trainer.batch.context_parallel import chunk_index, gather_positions
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, PackedSequences, pack_sequences
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.workers.megatron_model import MegatronModel

logger = logging.getLogger(__name__)
EXACT_FLOAT_IDS = 1 << 24  # ids ride the float32 gather of per-token results: exact below 2^24


class MegatronTeacher(MegatronModel):
    """A Megatron model scoring responses as a teacher (forward only, no gradient); `model` is a frozen teacher's or
    the actor's own (the self teacher). `config` (`actor_rollout_ref.actor`) sets the micro-batches, as for the
    reference."""

    def __init__(self, model: Any, pad_token_id: int, config: ActorConfig, topk: int, name: str,
                 log_prob_micro_batch_size: int = 0, use_remove_padding: bool = False) -> None:
        super().__init__(model, pad_token_id, config, use_fused_kernels=True, use_remove_padding=use_remove_padding)
        if topk and model.padded_vocab_size >= EXACT_FLOAT_IDS:
            raise ValueError(f"a vocabulary of {model.padded_vocab_size} ids does not fit the float32 gather of top-k "
                             "ids; use an engines teacher")
        self.topk = topk
        self.name = name
        self.log_prob_micro_batch_size = log_prob_micro_batch_size

    def _teacher_outputs(self, output: torch.Tensor, seqs) -> tuple[torch.Tensor, ...]:
        """The last stage's hidden states -> response-aligned [rows, R] tensors: the sampled tokens' log-probs, then
        (top-k) the k ids and the k log-probs, one tensor per id slot."""
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_group = tp_group if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
        hidden = gather_sequence_parallel(self.model, output).transpose(0, 1)
        weight, vocab = lm_head_weight(self.model), self.model.hf_vocab_size
        targets = seqs.targets.to(output.device)
        cp_size = self._cp_size()
        if cp_size > 1:
            targets = targets[:, chunk_index(seqs.length, cp_size, self._cp_rank()).to(targets.device)]
        per_position = [linear_log_probs_and_entropy(hidden, weight, targets, tp_group=tp_group,
                                                     ignore_index=IGNORE_INDEX, vocab_size=vocab)[0]]
        if self.topk:
            ids = linear_top_k(hidden, weight, self.topk, tp_group, vocab)
            top = linear_log_probs_and_entropy(hidden, weight, ids, tp_group=tp_group, vocab_size=vocab)[0]
            per_position += [*ids.float().unbind(-1), *top.unbind(-1)]
        if cp_size > 1:
            group = parallel_state.get_context_parallel_group()
            per_position = [gather_positions(tensor, seqs.length, group) for tensor in per_position]
        return tuple(seqs.to_response(tensor) for tensor in per_position)

    @torch.no_grad()
    def score_sequences(self, seqs: PackedSequences) -> TeacherScores:
        """The teacher's scores of every response of `seqs`, [rows, R(, k)], on every rank."""
        self._module.eval()
        padded, plan = self._plan(seqs, self.config.log_prob_max_token_len_per_gpu,
                                  "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu",
                                  self.log_prob_micro_batch_size or self.config.ppo_micro_batch_size_per_gpu)
        count = 1 + 2 * self.topk
        outputs = self._run(self._micro_batches(padded, plan), self._teacher_outputs,
                            lambda *tensors: (torch.zeros((), device=tensors[0].device), tensors[:-1]),
                            forward_only=True)
        rows = self._gather_rows(outputs, plan, padded.rows, seqs, count=count)
        if not self.topk:
            return TeacherScores(rows[0])
        return TeacherScores(rows[0], torch.stack(rows[1:1 + self.topk], -1).round().long(),
                             torch.stack(rows[1 + self.topk:], -1))

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TeacherScores:
        """`Teacher.score`: every response after its prompt, [N, longest response(, k)]; every rank calls it with the
        same rows."""
        width = max((len(response) for response in responses), default=0)
        seqs = pack_sequences([list(p) for p in prompts], [list(r) for r in responses], self.pad_token_id,
                              max(width, 1))
        scores = self.score_sequences(seqs)
        scores.check_finite([len(r) for r in responses], [f"row {i}" for i in range(len(responses))], self.name)
        return scores if width else TeacherScores(scores.log_probs[:, :0])

    def shutdown(self) -> None:
        """Nothing to release: the model lives as long as the trainer."""


def build_megatron_teacher(name: str, teacher: TeacherModelConfig, actor: ActorConfig, pad_token_id: int, topk: int,
                           log_prob_micro_batch_size: int = 0, use_remove_padding: bool = False) -> MegatronTeacher:
    """The frozen teacher `name` (`kind: megatron`) of this rank, built from `teacher.model_path` in the actor's
    layout and dtype; its weights are `teacher.load`'s Megatron checkpoint when set, else the Hugging Face ones."""
    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.models.checkpoint import load_checkpoint
    from megatron_cpo.models.families import family_of
    from megatron_cpo.models.weight_mapping import load_hf_weights
    from megatron_cpo.trainer.workers.policies import model_options

    hf_config = load_hf_config(teacher.model_path)
    moe = family_of(hf_config).moe(hf_config) is not None
    model = build_gpt_model(hf_config, params_dtype=getattr(torch, actor.megatron.compute_dtype),
                            **model_options(actor.megatron, False, moe))
    if teacher.load:
        load_checkpoint(model, teacher.load)
    else:
        load_hf_weights(model, teacher.model_path)
    model.requires_grad_(False)
    logger.info("distillation teacher %s: %s (%s) in the actor's layout", name, teacher.model_path,
                f"weights from {teacher.load}" if teacher.load else "its Hugging Face weights")
    return MegatronTeacher(model, pad_token_id, actor, topk, name, log_prob_micro_batch_size, use_remove_padding)


def self_teacher(actor_model: Any, actor: ActorConfig, pad_token_id: int, topk: int,
                 log_prob_micro_batch_size: int = 0, use_remove_padding: bool = False) -> MegatronTeacher:
    """The policy as its own teacher (`kind: self`): the actor's model (this rank's, its current weights) scoring the
    hinted prompts given to `score` (the hint contexts: the gold solution in the context)."""
    return MegatronTeacher(actor_model, pad_token_id, actor, topk, "self", log_prob_micro_batch_size,
                           use_remove_padding)
