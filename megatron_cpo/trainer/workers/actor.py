"""The Megatron actor and its frozen reference, as every rank of the trainer runs them.

Both are `GPTModel`s run over sequence batches by megatron_model.py; the actor trains under Megatron DDP and the
(distributed) optimizer. Log-probs and entropy come from the fused kernel, on the vocab-parallel logits or, with
`use_fused_kernels`, on the hidden states and lm-head weight so the logits are never materialised.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from operator import itemgetter
from typing import Any

import torch

from megatron_cpo.algorithms.config import RolloutCorrectionConfig
from megatron_cpo.algorithms.distillation import METRIC_PREFIX as DISTILLATION_METRICS
from megatron_cpo.algorithms.distillation_config import DistillationLossConfig
from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy
from megatron_cpo.models.builder import gather_sequence_parallel, lm_head_weight
from megatron_cpo.trainer.batch.context_parallel import chunk_index, gather_positions
from megatron_cpo.trainer.batch.micro_batches import Plan
from megatron_cpo.trainer.batch.packing import PackedRows
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, PackedSequences
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.workers.distillation_step import StudentScorer, TeacherSignal
from megatron_cpo.trainer.workers.megatron_model import MegatronModel, TokenOutputs, with_zero_rows
from megatron_cpo.trainer.workers.policy_loss_step import LossOutput, PolicyLossStep, PolicyMicroBatch
from megatron_cpo.trainer.workers.routing import RecordedRouting, RouterTracker, aux_loss_metrics
from megatron_cpo.trainer.workers.shaping import ResponseShaping, ShapedAdvantages
from megatron_cpo.trainer.workers.update_guard import FiniteProbe, UpdateGuard


@dataclass(frozen=True)
class UpdateInputs:
    """Per-token tensors [rows, R] of one batch for the PPO update (response-aligned), and the off-policy correction
    that weights and masks the policy gradient by them (`algorithm.rollout_correction`, resolved; None: off).
    `old_log_probs` None: the update's own forward gives them (`MegatronPolicy.update_on_policy`); then `shaping`,
    when set, turns each micro-batch's `advantages` (the estimator's) into the ones to train on from that forward's
    log-probs and entropy (trainer/workers/shaping.py)."""
    advantages: torch.Tensor
    old_log_probs: torch.Tensor | None
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None
    correction: RolloutCorrectionConfig | None = None
    routing: RecordedRouting | None = None  # the old-log-prob pass's routing of the step batch (MoE)
    first_row: int = 0                      # this mini-batch's first row in the step batch
    shaping: ResponseShaping | None = None
    probe: FiniteProbe | None = None        # the step's finiteness flags so far (update_guard.py)
    teacher: TeacherSignal | None = None    # distillation: the teacher's scores of these rows
    distillation: DistillationLossConfig | None = None  # verl's distillation term of the loss (None: none)


@dataclass(frozen=True)
class OnPolicyUpdate:
    """What `update_on_policy` returns on every rank: the optimizer step's metrics, its forward's log-probs and entropy
    [rows, R] (the PPO ratio's old ones), and, when it shaped the advantages itself (`UpdateInputs.shaping`), the
    `ShapedAdvantages` it trained on, gathered over its micro-batches (None: it trained on `inputs.advantages`)."""
    metrics: dict[str, float]
    log_probs: torch.Tensor
    entropy: torch.Tensor
    shaped: ShapedAdvantages | None


@dataclass(frozen=True)
class _TrainStep:
    """One optimizer step on this rank: its metrics (every rank), each micro-batch's `LossOutput` (the last pipeline
    stage's; none elsewhere) and how the batch was cut, to gather their rows."""
    metrics: dict[str, float]
    outputs: list[LossOutput]
    plan: Plan
    padded_rows: int


DISTILLATION_LOSS_METRIC = DISTILLATION_METRICS + "loss"  # a share of the batch's term, summed like pg_loss
LOSS_GENERATOR_SEED = 20250702  # any fixed value: the stream only has to be the same on every rank


class MegatronPolicy(MegatronModel):
    """One Megatron model (this rank's TP slice / PP stage) with forward-only scoring and, if trainable, updates.

    `config` (`actor_rollout_ref.actor`) sets the loss and micro-batches (rows, or token budgets with
    `use_dynamic_bsz`); `log_prob_micro_batch_size` the rows of a scoring micro-batch (0: the update's); `routing`
    records and replays a mixture of experts' routing (routing.py).
    """

    def __init__(self, model: Any, pad_token_id: int, config: ActorConfig, log_prob_micro_batch_size: int = 0,
                 ddp_model: Any = None, optimizer: Any = None, scheduler: Any = None, use_fused_kernels: bool = False,
                 use_remove_padding: bool = False, routing: RouterTracker | None = None) -> None:
        super().__init__(model, pad_token_id, config, ddp_model, optimizer, scheduler, use_fused_kernels,
                         use_remove_padding)
        self.routing = routing
        # no optimizer step applies a non-finite value; too many skipped in a row end the run (update_guard.py)
        self.guard = UpdateGuard("actor", config.max_consecutive_skipped_updates,
                                 "actor_rollout_ref.actor.max_consecutive_skipped_updates") if optimizer else None
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        # the loss mode's random choices (Clip-Cov's tokens): one seeded stream per rank, drawn in the same order on
        # every TP rank of a data-parallel rank, so the ranks that compute the same loss choose the same tokens
        self.loss_generator = torch.Generator().manual_seed(LOSS_GENERATOR_SEED)

    def _token_outputs(self, temperature: float) -> TokenOutputs:
        """The last stage's output -> response-aligned (log-probs, entropy) at `temperature`."""
        return lambda output, layout: self._log_probs_entropy(output, layout, temperature)

    def _update_token_outputs(self, temperature: float) -> TokenOutputs:
        """The update's: `_token_outputs`' and a `StudentScorer` of other ids at the same positions (distillation's
        top-k losses; it computes only when called)."""
        return lambda output, layout: (*self._log_probs_entropy(output, layout, temperature),
                                       StudentScorer(self.model, self.use_fused_kernels, output, layout, temperature,
                                                     self._cp_size(), self._cp_rank() if self._cp_size() > 1 else 0))

    def _log_probs_entropy(self, output: torch.Tensor, seqs: PackedSequences | PackedRows, temperature: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Response-aligned log-probs and entropy from the last stage's output (padded or packed rows): logits
        `[b, s, V_local]`, or with fused kernels the final hidden states `[s, b, h]` times the lm-head weight."""
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        tp_group = tp_group if parallel_state.get_tensor_model_parallel_world_size() > 1 else None
        targets = seqs.targets.to(output.device)
        cp_size = self._cp_size()
        if cp_size > 1:
            targets = targets[:, chunk_index(seqs.length, cp_size, self._cp_rank()).to(targets.device)]
        if self.use_fused_kernels:
            hidden = gather_sequence_parallel(self.model, output).transpose(0, 1)
            log_probs, entropy = linear_log_probs_and_entropy(
                hidden, lm_head_weight(self.model), targets, temperature=temperature,
                tp_group=tp_group, ignore_index=IGNORE_INDEX, vocab_size=self.model.hf_vocab_size)
        else:
            log_probs, entropy = log_probs_and_entropy(
                output, targets, temperature=temperature, tp_group=tp_group, ignore_index=IGNORE_INDEX,
                vocab_size=self.model.hf_vocab_size)
        if cp_size > 1:
            group = parallel_state.get_context_parallel_group()
            log_probs = gather_positions(log_probs, seqs.length, group)
            entropy = gather_positions(entropy, seqs.length, group)
        return seqs.to_response(log_probs), seqs.to_response(entropy)

    def log_probs(self, seqs: PackedSequences, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of every response token, [rows, R] float32 each, on every rank."""
        return self._score(seqs, temperature)[:2]

    def log_probs_and_routing(self, seqs: PackedSequences, temperature: float
                              ) -> tuple[torch.Tensor, torch.Tensor, RecordedRouting | None, dict[str, float]]:
        """`log_probs`, and for a mixture of experts the routing of every token (for the update to replay or
        compare) with its load and entropy metrics."""
        return self._score(seqs, temperature, record_routing=self.routing is not None)

    @torch.no_grad()
    def _score(self, seqs: PackedSequences, temperature: float, record_routing: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor, RecordedRouting | None, dict[str, float]]:
        self._module.eval()
        padded, plan = self._plan(seqs, self.config.log_prob_max_token_len_per_gpu,
                                  "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu",
                                  self.log_prob_micro_batch_size or self.config.ppo_micro_batch_size_per_gpu)
        outputs = self._run(self._micro_batches(padded, plan), self._token_outputs(temperature),
                            lambda log_probs, entropy, batch: (torch.zeros((), device=log_probs.device),
                                                               (log_probs, entropy)),
                            forward_only=True,
                            around_forward=(lambda batch, layout: self.routing.recording(layout, batch.rows))
                            if record_routing else None)
        routing, routing_metrics = (self.routing.finish_recording(plan, seqs.lengths()) if record_routing
                                    else (None, {}))
        return (*self._gather_rows(outputs, plan, padded.rows, seqs, count=2), routing, routing_metrics)

    def update(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float) -> dict[str, float]:
        """One optimizer step on `seqs` (a mini-batch): forward/backward over micro-batches, clip, Adam, schedule; the
        loss is `config`'s (`PolicyLossConfig`, which `ActorConfig` extends).

        The loss is aggregated over the whole mini-batch (all micro-batches and DP ranks), so the update does not
        depend on how the mini-batch is split (fixed or token-budget micro-batches alike). A step whose loss or
        gradient norm is not finite on any rank is skipped on every rank (`actor/update_skipped`, update_guard.py).
        """
        return self._train_step(seqs, inputs, temperature).metrics

    def update_on_policy(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float) -> OnPolicyUpdate:
        """`update` whose PPO old log-probs are its own forward's, detached (`inputs.old_log_probs` is None): exact
        when the batch is one mini-batch trained once (`policy_update.old_log_probs_from_update`), and one forward
        cheaper than a separate scoring pass. With `inputs.shaping`, each micro-batch is shaped from that forward."""
        if inputs.old_log_probs is not None:
            raise ValueError("update_on_policy takes its old log-probs from its own forward; pass "
                             "UpdateInputs(old_log_probs=None) or call update()")
        step = self._train_step(seqs, inputs, temperature)
        shaping = inputs.shaping
        log_probs, entropy, *columns = self._gather_rows(
            [output.columns() for output in step.outputs], step.plan, step.padded_rows, seqs,
            count=2 + (shaping.column_count if shaping is not None else 0))
        shaped = shaping.from_columns(inputs.advantages, tuple(columns)) if shaping is not None else None
        return OnPolicyUpdate(step.metrics, log_probs, entropy, shaped)

    def _train_step(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float) -> _TrainStep:
        """The optimizer step: the micro-batches through Megatron's schedule with the loss step, then the guarded
        optimizer step."""
        padded, plan = self._plan(seqs, self.config.ppo_max_token_len_per_gpu,
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                  self.config.ppo_micro_batch_size_per_gpu)
        micro = self._update_micro_batches(seqs, padded, plan, inputs)
        loss_step = self._loss_step(seqs, inputs, len(micro))
        routed = self._replays(inputs)
        self._module.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, self._update_token_outputs(temperature), loss_step, forward_only=False,
                            around_forward=(lambda batch, layout: self.routing.updating(layout, batch.routing))
                            if routed else None)
        self.scheduler.step(increment=1)
        updated, grad_norm = self.guard.step(self.optimizer, loss_step.probe)
        metrics = self._reduce_metrics([output.metrics for output in outputs],
                                       {"pg_loss", "entropy", "kl_loss", DISTILLATION_LOSS_METRIC}, "actor")
        if routed:
            metrics.update(self.routing.finish_update())
        if self.routing is not None:
            metrics.update(aux_loss_metrics(self.model.config, self.config.megatron.override_transformer_config
                                            .aux_loss_names(), len(micro)))
        metrics.update({"actor/grad_norm": grad_norm, "actor/lr": self.optimizer.param_groups[0]["lr"],
                        "actor/update_skipped": float(not updated)})
        return _TrainStep(metrics, outputs, plan, padded.rows)

    def _update_micro_batches(self, seqs: PackedSequences, padded: PackedSequences, plan: Plan,
                              inputs: UpdateInputs) -> list[PolicyMicroBatch]:
        """This rank's micro-batches with their rows of `inputs` (zero rows for the plan's padding) and, for a mixture
        of experts that replays or compares it, each row's recorded routing, fetched from the ranks that scored it."""
        per_token = [with_zero_rows(tensor, padded.rows) if tensor is not None else None for tensor in
                     (inputs.advantages, inputs.old_log_probs, inputs.ref_log_probs, inputs.rollout_log_probs)]
        shaping = (inputs.shaping.map_rows(partial(with_zero_rows, rows=padded.rows)) if inputs.shaping is not None
                   else None)
        teacher = (inputs.teacher.map_rows(partial(with_zero_rows, rows=padded.rows)) if inputs.teacher is not None
                   else None)
        recorded = (self.routing.rows_for_update(inputs.routing, inputs.first_row, plan, seqs.rows)
                    if self._replays(inputs) else None)
        micro = []
        for batch in self._micro_batches(padded, plan):
            take = itemgetter(batch.rows)
            advantages, old, ref, rollout = (take(tensor) if tensor is not None else None for tensor in per_token)
            routing = (None if recorded is None else [recorded.get(inputs.first_row + row) if row < seqs.rows else None
                                                      for row in batch.rows.tolist()])
            micro.append(PolicyMicroBatch(
                rows=batch.rows, seqs=batch.seqs, packed=batch.packed, advantages=advantages, old_log_probs=old,
                ref_log_probs=ref, rollout_log_probs=rollout,
                shaping=shaping.map_rows(take) if shaping is not None else None, routing=routing,
                teacher=teacher.map_rows(take) if teacher is not None else None))
        return micro

    def _replays(self, inputs: UpdateInputs) -> bool:
        """Whether the update replays or compares a recorded routing (a mixture of experts' actor with one given)."""
        return self.routing is not None and inputs.routing is not None

    def _loss_step(self, seqs: PackedSequences, inputs: UpdateInputs, micro_batches: int) -> PolicyLossStep:
        """The loss over the whole mini-batch (its tokens and sequences on every rank), times the schedule's divisor:
        it divides each micro-batch's loss by this rank's micro-batch count and DDP averages over DP."""
        from megatron.core import parallel_state

        mask = seqs.response_mask()
        return PolicyLossStep(
            self.config, inputs.correction, inputs.probe.for_update() if inputs.probe is not None else FiniteProbe(),
            self.loss_generator, global_tokens=float(mask.sum().clamp(min=1)),
            global_seqs=float((mask.sum(-1) > 0).sum().clamp(min=1)),
            scale=micro_batches * parallel_state.get_data_parallel_world_size(), distillation=inputs.distillation)

    @torch.no_grad()
    def mix_into(self, target: MegatronPolicy, alpha: float) -> None:
        """`target = alpha * self + (1 - alpha) * target`, parameter by parameter (the reference-model sync)."""
        for (name, mine), (other_name, theirs) in zip(self.model.named_parameters(), target.model.named_parameters()):
            if name != other_name or mine.shape != theirs.shape:
                raise RuntimeError(f"actor parameter {name} does not match reference parameter {other_name}")
            theirs.mul_(1 - alpha).add_(mine.detach(), alpha=alpha)
