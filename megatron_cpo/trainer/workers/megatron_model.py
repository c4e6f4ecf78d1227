"""What the actor, the reference and the critic share: a Megatron model of this rank (its TP slice / PP stage) run
over a batch of sequences, with per-token results that every rank ends up holding for the whole batch.

Every forward goes through Megatron's `get_forward_backward_func`, so pipeline parallelism works unchanged. Rows are
split over the data-parallel ranks and cut into micro-batches (a fixed row count, or with `use_dynamic_bsz` a token
budget: see `micro_batches`), padded right (with context parallelism, each CP rank's two chunks of every row) or packed
several to a row (`use_remove_padding`: THD through Transformer Engine's or torch's fused attention, else a
per-sequence mask on the local attention). Each rank computes its share; the per-token results of the last stage are
broadcast over PP and gathered over DP (`_gather_rows`), so the advantage math then runs identically everywhere. What
the per-token results are is the subclass's: log-probs and entropy for the policies (actor.py), values for the critic
(critic.py).
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.algorithms.distillation import METRIC_PREFIX as DISTILLATION_METRICS
from megatron_cpo.models.builder import decoder_hidden_states, output_logits, packing_layout
from megatron_cpo.trainer.batch.context_parallel import chunk_index
from megatron_cpo.trainer.batch.micro_batches import Plan, fixed_plan, token_budget_plan
from megatron_cpo.trainer.batch.packing import PackedRows, pack_rows
from megatron_cpo.trainer.batch.sequences import PackedSequences

TokenOutputs = Callable[[torch.Tensor, Any], tuple[torch.Tensor, ...]]
"""(last stage's output, the micro-batch's layout) -> response-aligned per-token tensors [rows, R]."""


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of this DP rank: its row indices into the padded batch, its sequences and, when rows are
    packed (`use_remove_padding`), their packed layout. The models extend it with their rows of per-token inputs."""
    rows: torch.Tensor
    seqs: PackedSequences
    packed: PackedRows | None = None

    @property
    def layout(self) -> PackedSequences | PackedRows:
        """What the forward runs on: the packed rows, else the padded ones."""
        return self.packed if self.packed is not None else self.seqs


def extreme_of(metric: str) -> str | None:
    """"min" / "max" for a metric reduced over micro-batches and ranks by its extreme (distillation's `loss_min`,
    `*_mass_max`, ...), else None."""
    if not metric.startswith(DISTILLATION_METRICS):
        return None
    return next((op for op in ("min", "max") if metric.endswith(f"_{op}")), None)


def with_zero_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """`tensor` (rows first) with zero rows appended up to `rows`: the values of a plan's empty padding rows."""
    return torch.cat([tensor, tensor.new_zeros((rows - tensor.shape[0], *tensor.shape[1:]))])


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _pad_rows(seqs: PackedSequences, multiple: int) -> PackedSequences:
    """Append empty rows (no response tokens) so the row count is a multiple of `multiple`."""
    extra = (-seqs.rows) % multiple
    return seqs.with_empty_rows(extra) if extra else seqs


class MegatronModel:
    """One Megatron model of this rank, run over sequence batches; trainable when given its DDP wrapper, optimizer
    and schedule. `config` is the section that sets its micro-batches (`use_dynamic_bsz` among them);
    `use_fused_kernels`: the last stage returns the final hidden states instead of its output layer's output."""

    def __init__(self, model: Any, pad_token_id: int, config: Any, ddp_model: Any = None, optimizer: Any = None,
                 scheduler: Any = None, use_fused_kernels: bool = False, use_remove_padding: bool = False) -> None:
        from megatron.core import parallel_state

        self.model = model
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.pad_token_id = pad_token_id
        self.config = config
        self.use_fused_kernels = use_fused_kernels
        # packed rows in the layout the model's core attention reads (THD, or masked rows on the local attention)
        self.packing = packing_layout(model) if use_remove_padding else None
        if self.packing and model.config.context_parallel_size > 1:
            raise ValueError("context parallelism splits padded rows only; set actor_rollout_ref.model."
                             "use_remove_padding=false or actor_rollout_ref.actor.megatron.context_parallel_size=1")
        if ((config.use_dynamic_bsz or self.packing) and parallel_state.get_pipeline_model_parallel_world_size() > 1):
            model.config.variable_seq_lengths = True  # micro-batches differ in shape; stages exchange shapes first

    @property
    def _module(self) -> Any:
        return self.ddp_model if self.ddp_model is not None else self.model

    def _run(self, micro_batches: list[MicroBatch], token_outputs: TokenOutputs, step_fn: Callable,
             forward_only: bool, around_forward: Callable[[MicroBatch, Any], Any] | None = None) -> list:
        """Megatron's schedule over `micro_batches`; the last stage's output becomes per-token tensors through
        `token_outputs`, and `step_fn(*those, batch)` is the loss function; `around_forward(batch, layout)`, when
        given, is a context manager around each micro-batch's forward."""
        from megatron.core.pipeline_parallel import get_forward_backward_func

        def forward_step(data_iterator, stage_model):
            batch = next(data_iterator)
            layout = batch.layout
            with around_forward(batch, layout) if around_forward else contextlib.nullcontext():
                output = self._forward(stage_model, layout)
            return output, lambda out: step_fn(*token_outputs(out, layout), batch)

        shapes = [tuple(b.layout.tokens_shape) for b in micro_batches]
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self._module],
            num_microbatches=len(micro_batches), seq_length=max(width for _, width in shapes),
            micro_batch_size=max(rows for rows, _ in shapes), forward_only=forward_only)

    def _forward(self, stage_model: Any, layout: PackedSequences | PackedRows) -> torch.Tensor:
        """This stage's output for right-padded rows (`PackedSequences`, causal mask) or packed rows (`PackedRows`:
        per-sequence mask and positions, or THD): the output layer's (logits, a critic's values), or with fused
        kernels the hidden states."""
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

    def _micro_batches(self, padded: PackedSequences, plan: Plan) -> list[MicroBatch]:
        """This DP rank's micro-batches of `padded` (each cut to its own longest row when dynamic)."""
        from megatron.core import parallel_state

        micro = []
        multiple = self._sequence_multiple()
        for index in plan[parallel_state.get_data_parallel_rank()]:
            seqs = padded.select(index)
            seqs = seqs.trimmed() if self.config.use_dynamic_bsz else seqs
            micro.append(MicroBatch(index, replace(seqs, length=_round_up(seqs.length, multiple)),
                                    pack_rows(seqs, self.packing, multiple) if self.packing else None))
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

    def _gather_rows(self, outputs: list[tuple[torch.Tensor, ...]], plan: Plan, padded_rows: int,
                     seqs: PackedSequences, count: int) -> tuple[torch.Tensor, ...]:
        """Every rank's per-micro-batch tuples of `count` [rows, R] tensors of the last stage (none elsewhere) -> the
        whole batch's `count` [rows, R] tensors, on every rank (broadcast from the last stage, gathered over DP)."""
        from megatron.core import parallel_state

        rank_rows = [torch.cat(micro) for micro in plan]
        local = torch.zeros(count, max(len(rows) for rows in rank_rows), seqs.response_width,
                            device=platform.device())
        if parallel_state.is_pipeline_last_stage():
            mine = len(rank_rows[parallel_state.get_data_parallel_rank()])
            for k in range(count):
                local[k, :mine] = torch.cat([output[k] for output in outputs]).to(local.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(local, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        pieces = [torch.empty_like(local) for _ in rank_rows]
        dist.all_gather(pieces, local, group=parallel_state.get_data_parallel_group())
        full = torch.zeros(count, padded_rows, seqs.response_width)
        for rows, piece in zip(rank_rows, pieces):
            full[:, rows] = piece[:, : len(rows)].cpu()
        return tuple(full[k, : seqs.rows] for k in range(count))

    def _reduce_metrics(self, outputs: list[dict], summed: set[str], prefix: str) -> dict[str, float]:
        """Micro-batch metrics summed where they are shares of the batch loss (`summed`), averaged otherwise; on
        every rank, each name without a `/` put under `prefix/`."""
        from megatron.core import parallel_state

        local: dict[str, float] = {}
        if parallel_state.is_pipeline_last_stage() and outputs:
            for key in outputs[0]:
                values = torch.stack([o[key] for o in outputs])
                extreme = extreme_of(key)
                local[key] = float(values.sum() if key in summed else getattr(values, extreme)() if extreme
                                   else values.mean())
        payload = [local]
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast_object_list(payload, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                       group=parallel_state.get_pipeline_model_parallel_group())
        keys = sorted(payload[0])
        values = torch.tensor([payload[0][k] for k in keys], dtype=torch.float64)
        dp_size = parallel_state.get_data_parallel_world_size()
        if dp_size > 1 and keys:
            values = values.to(platform.device())  # NCCL reduces device tensors only
            extremes = {op: values.clone() for op in ("min", "max")}
            dist.all_reduce(values, group=parallel_state.get_data_parallel_group())
            for op, reduced in extremes.items():
                if any(extreme_of(k) == op for k in keys):
                    dist.all_reduce(reduced, op=getattr(dist.ReduceOp, op.upper()),
                                    group=parallel_state.get_data_parallel_group())
            values = torch.where(torch.tensor([k in summed for k in keys]), values.cpu(), values.cpu() / dp_size)
            for op, reduced in extremes.items():
                values = torch.where(torch.tensor([extreme_of(k) == op for k in keys]), reduced.cpu(), values)
        return {(k if "/" in k else f"{prefix}/{k}"): float(v) for k, v in zip(keys, values)}
