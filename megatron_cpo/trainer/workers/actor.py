"""The Megatron actor and its frozen reference, as every rank of the trainer runs them.

Both are `GPTModel`s built from the HF config (TP x PP from `parallel_state`). The actor trains under Megatron DDP and
the (distributed) optimizer; the reference only scores. Every forward goes through Megatron's
`get_forward_backward_func`, so pipeline parallelism works unchanged, and every log-prob / entropy comes from the
fused kernel, with the padded vocabulary columns left out of the softmax: either on the vocab-parallel logits, or
(`use_fused_kernels`) on the final hidden states and the vocab-parallel lm-head weight, so the logits are never
materialised (`linear_log_probs_and_entropy`; tied embeddings use the shared weight).

Rows are split over the data-parallel ranks and cut into micro-batches (a fixed row count, or a token budget: see
`micro_batches`); each rank computes its share and the per-token results are gathered, so every rank ends with the
whole batch's tensors (the advantage math then runs identically everywhere).
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.algorithms.losses import policy_loss
from megatron_cpo.algorithms.config import RolloutCorrectionConfig
from megatron_cpo.kernels import linear_log_probs_and_entropy, log_probs_and_entropy
from megatron_cpo.models.builder import (decoder_hidden_states, gather_sequence_parallel, lm_head_weight,
                                         output_logits, uses_transformer_engine)
from megatron_cpo.trainer.batch.context_parallel import chunk_index, gather_positions
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.batch.micro_batches import Plan, fixed_plan, token_budget_plan
from megatron_cpo.trainer.batch.packing import PackedRows, pack_rows
from megatron_cpo.trainer.workers.routing import RecordedRouting, RouterTracker, aux_loss_metrics
from megatron_cpo.trainer.workers.update_guard import FiniteProbe, UpdateGuard
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, PackedSequences

if TYPE_CHECKING:
    from megatron_cpo.trainer.workers.shaping import ResponseShaping


@dataclass
class UpdateInputs:
    """Per-token tensors [rows, R] of one batch for the PPO update (response-aligned), and the off-policy correction
    that weights and masks the policy gradient by them (`algorithm.rollout_correction`, resolved; None: off).
    `old_log_probs` None: the update's own forward gives them (`MegatronPolicy.update_on_policy`); then `shaping`,
    when set, turns each micro-batch's `advantages` (GRPO's) into the ones to train on from that forward's
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


LOSS_GENERATOR_SEED = 20250702  # any fixed value: the stream only has to be the same on every rank


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad_rows(seqs: PackedSequences, multiple: int) -> PackedSequences:
    """Append empty rows (no response tokens) so the row count is a multiple of `multiple`."""
    extra = (-seqs.rows) % multiple
    return seqs.with_empty_rows(extra) if extra else seqs


class MegatronPolicy:
    """One Megatron model (this rank's TP slice / PP stage) with forward-only scoring and, if trainable, updates.

    `config` (`actor_rollout_ref.actor`, as it is) sets the loss and the micro-batches: `ppo_micro_batch_size_per_gpu`
    rows, or with `use_dynamic_bsz` the token budgets `ppo_max_token_len_per_gpu` (update) and
    `log_prob_max_token_len_per_gpu` (scoring). `log_prob_micro_batch_size`: rows of a fixed scoring micro-batch
    (verl's `rollout.` / `ref.log_prob_micro_batch_size_per_gpu`; 0: `ppo_micro_batch_size_per_gpu`).
    `routing` (a mixture of experts' actor): records the old-log-prob pass's routing and replays or compares it in
    the update (trainer/workers/routing.py)."""

    def __init__(self, model: Any, pad_token_id: int, config: ActorConfig, log_prob_micro_batch_size: int = 0,
                 ddp_model: Any = None, optimizer: Any = None, scheduler: Any = None, use_fused_kernels: bool = False,
                 use_remove_padding: bool = False, routing: RouterTracker | None = None) -> None:
        from megatron.core import parallel_state

        self.model = model
        self.routing = routing
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        # no optimizer step applies a non-finite value; too many skipped in a row end the run (update_guard.py)
        self.guard = UpdateGuard("actor", config.max_consecutive_skipped_updates,
                                 "actor_rollout_ref.actor.max_consecutive_skipped_updates") if optimizer else None
        self.pad_token_id = pad_token_id
        self.config = config
        self.log_prob_micro_batch_size = log_prob_micro_batch_size
        self.use_fused_kernels = use_fused_kernels
        # the loss mode's random choices (Clip-Cov's tokens): one seeded stream per rank, drawn in the same order on
        # every TP rank of a data-parallel rank, so the ranks that compute the same loss choose the same tokens
        self.loss_generator = torch.Generator().manual_seed(LOSS_GENERATOR_SEED)
        # packed rows: THD through Transformer Engine when the model uses it, else masked rows on the local attention
        self.packing = ("thd" if uses_transformer_engine() else "rows") if use_remove_padding else None
        if self.packing and model.config.context_parallel_size > 1:
            raise ValueError("context parallelism splits padded rows only; set actor_rollout_ref.model."
                             "use_remove_padding=false or actor_rollout_ref.actor.megatron.context_parallel_size=1")
        if ((config.use_dynamic_bsz or self.packing) and parallel_state.get_pipeline_model_parallel_world_size() > 1):
            model.config.variable_seq_lengths = True  # micro-batches differ in shape; stages exchange shapes first

    @property
    def _module(self) -> Any:
        return self.ddp_model if self.ddp_model is not None else self.model

    def _run(self, micro_batches: list[dict], temperature: float, step_fn: Callable, forward_only: bool,
             around_forward: Callable[[dict, Any], Any] | None = None) -> list:
        """Megatron's schedule over `micro_batches`; `step_fn(log_probs, entropy, batch)` is the loss function;
        `around_forward(batch, layout)`, when given, is a context manager around each micro-batch's forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, stage_model):
            batch = next(data_iterator)
            layout = batch.get("packed", batch["seqs"])
            with around_forward(batch, layout) if around_forward else contextlib.nullcontext():
                output = self._forward(stage_model, layout)
            return output, lambda out: step_fn(*self._log_probs_entropy(out, layout, temperature), batch)

        shapes = [tuple(b.get("packed", b["seqs"]).tokens_shape) for b in micro_batches]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self._module],
            num_microbatches=len(micro_batches), seq_length=max(width for _, width in shapes),
            micro_batch_size=max(rows for rows, _ in shapes), forward_only=forward_only)

    def _forward(self, stage_model: Any, layout: PackedSequences | PackedRows) -> torch.Tensor:
        """This stage's output for right-padded rows (`PackedSequences`, causal mask) or packed rows (`PackedRows`:
        per-sequence mask and positions, or THD): logits, or with fused kernels the hidden states."""
        device = platform.device()
        tokens = layout.tokens.to(device)
        if isinstance(layout, PackedRows):
            positions = layout.positions.to(device)
            if layout.layout == "thd":
                hidden = decoder_hidden_states(stage_model, tokens, positions,
                                               packed_seq_params=layout.packed_seq_params(device))
            else:
                hidden = decoder_hidden_states(stage_model, tokens, positions, layout.attention_mask(device))
            return hidden if self.use_fused_kernels else output_logits(stage_model, hidden)
        positions = torch.arange(tokens.shape[1], device=device).unsqueeze(0).expand_as(tokens)
        if self._cp_size() > 1:  # this CP rank's two chunks of every row
            index = chunk_index(tokens.shape[1], self._cp_size(), self._cp_rank()).to(device)
            tokens, positions = tokens[:, index], positions[:, index]
        if self.use_fused_kernels:
            return decoder_hidden_states(stage_model, tokens, positions)
        return stage_model(tokens, positions, attention_mask=None)

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
            log_probs, entropy = linear_log_probs_and_entropy(
                gather_sequence_parallel(self.model, output).transpose(0, 1), lm_head_weight(self.model), targets, temperature=temperature,
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

    def _plan(self, seqs: PackedSequences, token_budget: int, budget_name: str, micro_rows: int
              ) -> tuple[PackedSequences, Plan]:
        """`seqs` padded with empty rows as the mode needs, and every DP rank's micro-batches (row indices) of it:
        `micro_rows` rows each, or cut by `token_budget` with `use_dynamic_bsz`."""
        from megatron.core import parallel_state

        dp_size = parallel_state.get_data_parallel_world_size()
        if not self.config.use_dynamic_bsz:
            padded = _pad_rows(seqs, dp_size * micro_rows)
            return padded, fixed_plan(padded.rows, dp_size, micro_rows)
        padded = _pad_rows(seqs, dp_size) if seqs.rows < dp_size else seqs
        stages = parallel_state.get_pipeline_model_parallel_world_size()
        return padded, token_budget_plan(padded.lengths(), dp_size, token_budget, budget_name, stages,
                                         packed=self.packing is not None)

    def _micro_batches(self, padded: PackedSequences, plan: Plan, extra: dict[str, torch.Tensor] | None = None
                       ) -> list[dict]:
        """This DP rank's micro-batches: sequences (cut to their own longest row when dynamic) and extra rows."""
        from megatron.core import parallel_state

        full = {name: torch.cat([tensor, tensor.new_zeros((padded.rows - tensor.shape[0], *tensor.shape[1:]))])
                for name, tensor in (extra or {}).items()}  # zero rows for the empty padding rows, made once
        micro = []
        for index in plan[parallel_state.get_data_parallel_rank()]:
            seqs = padded.select(index)
            seqs = seqs.trimmed() if self.config.use_dynamic_bsz else seqs
            multiple = self._sequence_multiple()
            batch = {"seqs": replace(seqs, length=_round_up(seqs.length, multiple)), "rows": index}
            if self.packing:
                batch["packed"] = pack_rows(seqs, self.packing, multiple)
            batch.update({name: tensor[index] for name, tensor in full.items()})
            micro.append(batch)
        return micro

    def _sequence_multiple(self) -> int:
        """Rows are padded to a multiple of the TP size under sequence parallelism (they are split over TP) and of
        2 x CP under context parallelism (two chunks per CP rank)."""
        from megatron.core import parallel_state

        tp = parallel_state.get_tensor_model_parallel_world_size() if self.model.config.sequence_parallel else 1
        cp = self._cp_size()
        return math.lcm(tp, 2 * cp) if cp > 1 else tp

    def _cp_size(self) -> int:
        return self.model.config.context_parallel_size

    def _cp_rank(self) -> int:
        from megatron.core import parallel_state

        return parallel_state.get_context_parallel_rank()

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
        outputs = self._run(self._micro_batches(padded, plan), temperature,
                            lambda log_probs, entropy, batch: (torch.zeros((), device=log_probs.device),
                                                               (log_probs, entropy)),
                            forward_only=True,
                            around_forward=(lambda batch, layout: self.routing.recording(layout, batch["rows"]))
                            if record_routing else None)
        routing, routing_metrics = (self.routing.finish_recording(plan, seqs.lengths()) if record_routing
                                    else (None, {}))
        return (*self._gather_rows(outputs, plan, padded.rows, seqs), routing, routing_metrics)

    def _gather_rows(self, outputs: list[tuple[torch.Tensor, torch.Tensor]], plan: Plan, padded_rows: int,
                     seqs: PackedSequences) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's per-micro-batch (log-probs, entropy) of the last stage -> the whole batch's [rows, R] pair,
        on every rank (broadcast from the last stage, gathered over DP)."""
        from megatron.core import parallel_state

        rank_rows = [torch.cat(micro) for micro in plan]
        local = torch.zeros(2, max(len(rows) for rows in rank_rows), seqs.response_width, device=platform.device())
        if parallel_state.is_pipeline_last_stage():
            mine = len(rank_rows[parallel_state.get_data_parallel_rank()])
            local[0, :mine] = torch.cat([lp for lp, _ in outputs]).to(local.device)
            local[1, :mine] = torch.cat([ent for _, ent in outputs]).to(local.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(local, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        pieces = [torch.empty_like(local) for _ in rank_rows]
        dist.all_gather(pieces, local, group=parallel_state.get_data_parallel_group())
        full = torch.zeros(2, padded_rows, seqs.response_width)
        for rows, piece in zip(rank_rows, pieces):
            full[:, rows] = piece[:, : len(rows)].cpu()
        return full[0, : seqs.rows], full[1, : seqs.rows]

    def update(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float) -> dict[str, float]:
        """One optimizer step on `seqs` (a mini-batch): forward/backward over micro-batches, clip, Adam, schedule; the
        loss is `config`'s (`PolicyLossConfig`, which `ActorConfig` extends).

        The loss is aggregated over the whole mini-batch (all micro-batches and DP ranks), so the update does not
        depend on how the mini-batch is split (fixed or token-budget micro-batches alike). A step whose loss or
        gradient norm is not finite on any rank is skipped on every rank (`actor/update_skipped`, update_guard.py).
        """
        return self._update(seqs, inputs, temperature)[0]

    def update_on_policy(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float
                         ) -> tuple[dict[str, float], torch.Tensor, torch.Tensor]:
        """`update` whose PPO old log-probs are its own forward's, detached (`inputs.old_log_probs` is None): exact
        when the batch is one mini-batch trained once (`policy_update.old_log_probs_from_update`), and one forward
        cheaper than a separate scoring pass. Also returns those log-probs and the entropy, [rows, R] each, on every
        rank."""
        if inputs.old_log_probs is not None:
            raise ValueError("update_on_policy takes its old log-probs from its own forward; pass "
                             "UpdateInputs(old_log_probs=None) or call update()")
        metrics, outputs, plan, padded_rows = self._update(seqs, inputs, temperature)
        log_probs, entropy = self._gather_rows([(lp, ent) for _, lp, ent in outputs], plan, padded_rows, seqs)
        return metrics, log_probs, entropy

    def _update(self, seqs: PackedSequences, inputs: UpdateInputs, temperature: float
                ) -> tuple[dict[str, float], list, Plan, int]:
        """The optimizer step; also this rank's per-micro-batch (metrics, log-probs, entropy) outputs and the plan."""
        from megatron.core import parallel_state

        mask = seqs.response_mask()
        global_tokens = float(mask.sum().clamp(min=1))
        global_seqs = float((mask.sum(-1) > 0).sum().clamp(min=1))
        extra = {"advantages": inputs.advantages}
        if inputs.old_log_probs is not None:
            extra["old_log_probs"] = inputs.old_log_probs
        if inputs.ref_log_probs is not None:
            extra["ref_log_probs"] = inputs.ref_log_probs
        if inputs.rollout_log_probs is not None:
            extra["rollout_log_probs"] = inputs.rollout_log_probs
        shaping_rows = inputs.shaping.row_inputs() if inputs.shaping is not None else {}
        extra.update({f"shaping/{name}": tensor for name, tensor in shaping_rows.items()})
        padded, plan = self._plan(seqs, self.config.ppo_max_token_len_per_gpu,
                                  "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
                                  self.config.ppo_micro_batch_size_per_gpu)
        micro = self._micro_batches(padded, plan, extra)
        routed = self.routing is not None and inputs.routing is not None
        if routed:  # each micro-batch's rows' recorded routing, fetched from the ranks that scored them
            recorded = self.routing.rows_for_update(inputs.routing, inputs.first_row, plan, seqs.rows)
            for batch in micro:
                batch["routing"] = [recorded.get(inputs.first_row + row) if row < seqs.rows else None
                                    for row in batch["rows"].tolist()]
        # the schedule divides each micro-batch's loss by this rank's micro-batch count and DDP averages over DP
        scale = len(micro) * parallel_state.get_data_parallel_world_size()
        probe = inputs.probe.for_update() if inputs.probe is not None else FiniteProbe()

        def loss_step(log_probs, entropy, batch):
            device = log_probs.device
            response_mask = batch["seqs"].response_mask().to(device)
            old = batch["old_log_probs"].to(device) if "old_log_probs" in batch else log_probs.detach()
            advantages = batch["advantages"].to(device)
            probe.observe("log-probs", log_probs, response_mask)
            if inputs.shaping is not None:  # the shaper reads this forward's log-probs (on-policy: the old ones)
                advantages = inputs.shaping(advantages, response_mask, old, entropy.detach(),
                                            {name: batch[f"shaping/{name}"].to(device) for name in shaping_rows})
                probe.observe("advantages", advantages, response_mask)
            loss, metrics = policy_loss(
                log_probs, old, advantages, response_mask, self.config, entropy=entropy,
                ref_log_probs=batch["ref_log_probs"].to(device) if "ref_log_probs" in batch else None,
                rollout_log_probs=batch["rollout_log_probs"].to(device) if "rollout_log_probs" in batch else None,
                global_tokens=global_tokens, global_seqs=global_seqs, correction=inputs.correction,
                generator=self.loss_generator)
            probe.observe("loss", loss)
            return loss * scale, ({k: torch.tensor(float(v)) for k, v in metrics.items()}, log_probs.detach(),
                                  entropy.detach())

        self._module.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, temperature, loss_step, forward_only=False,
                            around_forward=(lambda batch, layout: self.routing.updating(layout, batch["routing"]))
                            if routed else None)
        self.scheduler.step(increment=1)
        updated, grad_norm = self.guard.step(self.optimizer, probe)
        metrics = self._reduce_metrics([output[0] for output in outputs])
        if routed:
            metrics.update(self.routing.finish_update())
        if self.routing is not None:
            metrics.update(aux_loss_metrics(self.model.config, self.config.megatron.override_transformer_config
                                            .aux_loss_names(), len(micro)))
        metrics.update({"actor/grad_norm": grad_norm, "actor/lr": self.optimizer.param_groups[0]["lr"],
                        "actor/update_skipped": float(not updated)})
        return metrics, outputs, plan, padded.rows

    def _reduce_metrics(self, outputs: list[dict]) -> dict[str, float]:
        """Micro-batch metrics summed where they are shares of the batch loss, averaged otherwise; on every rank."""
        from megatron.core import parallel_state

        summed = {"pg_loss", "entropy", "kl_loss"}
        local: dict[str, float] = {}
        if parallel_state.is_pipeline_last_stage() and outputs:
            for key in outputs[0]:
                values = torch.stack([o[key] for o in outputs])
                local[key] = float(values.sum() if key in summed else values.mean())
        payload = [local]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
        keys = sorted(payload[0])
        values = torch.tensor([payload[0][k] for k in keys], dtype=torch.float64)
        dp_size = parallel_state.get_data_parallel_world_size()
        if dp_size > 1 and keys:
            values = values.to(platform.device())  # NCCL reduces device tensors only
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
            values = values.cpu()
            values = torch.where(torch.tensor([k in summed for k in keys]), values, values / dp_size)
        return {(k if "/" in k else f"actor/{k}"): float(v) for k, v in zip(keys, values)}

    @torch.no_grad()
    def mix_into(self, target: "MegatronPolicy", alpha: float) -> None:
        """`target = alpha * self + (1 - alpha) * target`, parameter by parameter (the reference-model sync)."""
        for (name, mine), (other_name, theirs) in zip(self.model.named_parameters(), target.model.named_parameters()):
            if name != other_name or mine.shape != theirs.shape:
                raise RuntimeError(f"actor parameter {name} does not match reference parameter {other_name}")
            theirs.mul_(1 - alpha).add_(mine.detach(), alpha=alpha)
