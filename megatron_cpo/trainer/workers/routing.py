"""Mixture-of-experts routing in the trainer: what every router chose, replaying it (R2), and the routing metrics.

The old-log-prob pass records each token's top-k experts per layer in a layout independent of the micro-batch
split; the update receives its rows (one all-to-all) and replays (R2) or compares them (docs/trainer.md, moe.md).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.trainer.batch.packing import PackedRows
from megatron_cpo.trainer.batch.sequences import PackedSequences


def moe_routers(model: Any) -> list[Any]:
    """This stage's routers (Megatron `TopKRouter`s) in layer order; empty for a dense model."""
    from megatron.core.transformer.moe.router import TopKRouter

    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def freeze_routers(model: Any) -> int:
    """Keep every router's weights as loaded (`megatron.freeze_moe_router`); call before the DDP wrapper, which
    allocates gradients only for trainable parameters. Returns how many routers were frozen."""
    routers = moe_routers(model)
    for router in routers:
        router.requires_grad_(False)
    return len(routers)


def token_slots(layout: PackedSequences | PackedRows) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each real token of a micro-batch sits in the routers' input: Megatron's hidden states are
    [positions, rows, hidden], flattened position-major, so token j of a sequence that starts at (row, column) is
    slot (column + j) x rows + row. Returns the slots of every sequence's tokens in order, and each sequence's token
    count (right-padded rows start at column 0; packed rows at their `starts`)."""
    if isinstance(layout, PackedRows):
        lengths, rows = layout.seqs.lengths(), layout.rows
        row, column = layout.starts // layout.width, layout.starts % layout.width
    else:
        lengths, rows = layout.lengths(), layout.rows
        row, column = torch.arange(rows), torch.zeros(rows, dtype=torch.long)
    owner = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
    within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    return (column[owner] + within) * rows + row[owner], lengths


@dataclass
class RecordedRouting:
    """The old-log-prob pass's routing of a step batch on this stage: the rows this data-parallel rank scored
    (row -> uint8/int16 [tokens, MoE layers, k], expert ids ascending), and for every row of the batch the rank that
    scored it and its token count."""
    rows: dict[int, torch.Tensor]
    owner: torch.Tensor
    lengths: torch.Tensor


@dataclass
class _Tally:
    """Routing statistics summed over a pass's micro-batches (this rank's tokens)."""
    load: torch.Tensor | None = None        # [layers, experts] tokens routed to each expert
    entropy: torch.Tensor | None = None     # [layers] summed router entropy
    tokens: int = 0
    changed: int = 0                        # (token, layer) routings whose top-k differs from the recorded one
    compared: int = 0
    rows: dict[int, torch.Tensor] = field(default_factory=dict)


class RouterTracker:
    """Capture, record, exchange and replay the routing of one model's MoE layers on this pipeline stage."""

    def __init__(self, model: Any, replay: bool) -> None:
        self.model = model
        self.routers = moe_routers(model)
        self.replay = replay
        self.top_k = model.config.moe_router_topk
        self.num_experts = model.config.num_moe_experts
        self.dtype = torch.uint8 if self.num_experts <= 256 else torch.int16
        self._captured: list[tuple[torch.Tensor, torch.Tensor | None]] | None = None
        self._with_entropy = False
        self._tally = _Tally()
        for router in self.routers:
            router.register_forward_hook(self._hook)

    # --- capture -----------------------------------------------------------------------------------------------
    def _hook(self, router: Any, inputs: tuple, output: tuple) -> None:
        if self._captured is None:
            return  # not a forward we measure (the reference, a recompute inside the backward, ...)
        _, routing_map = output
        chosen = routing_map.nonzero()[:, 1].view(-1, self.top_k)  # expert ids of each token, ascending
        entropy = None
        if self._with_entropy:
            with torch.no_grad():
                hidden = inputs[0].reshape(-1, inputs[0].shape[-1]).float()
                bias = router.bias.float() if router.bias is not None else None
                log_p = torch.log_softmax(torch.nn.functional.linear(hidden, router.weight.float(), bias), dim=-1)
                entropy = -(log_p.exp() * log_p).sum(-1)
        self._captured.append((chosen.detach(), entropy))

    @contextlib.contextmanager
    def _capturing(self, with_entropy: bool) -> Iterator[None]:
        self._captured, self._with_entropy = [], with_entropy
        try:
            yield
        finally:
            self._captured = None

    def _gathered(self, layout: PackedSequences | PackedRows) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The captured forward's routing of every real token, [tokens, layers, k] (sequence by sequence), and the
        router entropy [layers, tokens] when measured; gathered over TP when sequence parallelism split the tokens."""
        from megatron.core import parallel_state

        chosen = torch.stack([c for c, _ in self._captured])
        entropy = torch.stack([e for _, e in self._captured]) if self._with_entropy else None
        if self.model.config.sequence_parallel:
            group = parallel_state.get_tensor_model_parallel_group()
            chosen = _gather_tokens(chosen, group)
            entropy = _gather_tokens(entropy, group) if entropy is not None else None
        slots, _ = token_slots(layout)
        slots = slots.to(chosen.device)
        return (chosen[:, slots].permute(1, 0, 2).cpu(),
                entropy[:, slots].cpu() if entropy is not None else None)

    # --- the old-log-prob pass -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def recording(self, layout: PackedSequences | PackedRows, rows: torch.Tensor) -> Iterator[None]:
        """Record the routing of one micro-batch's forward (`rows`: its rows' indices in the batch; those past the
        batch are padding and are not kept), its expert loads and router entropy."""
        with self._capturing(with_entropy=True):
            yield
            if not self._captured:
                return
            chosen, entropy = self._gathered(layout)
        tally = self._tally
        experts = chosen.permute(1, 0, 2).reshape(len(self.routers), -1).long()
        counts = torch.zeros(len(self.routers), self.num_experts, dtype=torch.float64)
        counts.scatter_add_(1, experts, torch.ones_like(experts, dtype=torch.float64))
        tally.load = counts if tally.load is None else tally.load + counts
        summed = entropy.double().sum(-1)
        tally.entropy = summed if tally.entropy is None else tally.entropy + summed
        tally.tokens += chosen.shape[0]
        _, lengths = token_slots(layout)
        for row, piece in zip(rows.tolist(), torch.split(chosen, lengths.tolist())):
            tally.rows[row] = piece.to(self.dtype)

    def finish_recording(self, plan: list[list[torch.Tensor]], lengths: torch.Tensor
                         ) -> tuple[RecordedRouting, dict[str, float]]:
        """The pass's `RecordedRouting` (`plan`: every DP rank's micro-batches of batch rows, as the pass cut them;
        `lengths`: each row's token count) and its load / entropy metrics (collective over DP and PP)."""
        from megatron.core import parallel_state

        tally, self._tally = self._tally, _Tally()
        owner = torch.full((len(lengths),), -1, dtype=torch.long)
        for rank, micro in enumerate(plan):
            index = torch.cat(micro) if micro else torch.empty(0, dtype=torch.long)
            owner[index[index < len(lengths)]] = rank
        metrics: dict[str, float] = {}
        if self.routers:
            stats = torch.cat([tally.load.flatten(), tally.entropy, torch.tensor([float(tally.tokens)])])
            stats = _all_reduce(stats, parallel_state.get_data_parallel_group())
            layers = len(self.routers)
            load = stats[: layers * self.num_experts].view(layers, self.num_experts)
            entropy = stats[layers * self.num_experts: -1] / stats[-1].clamp(min=1)
            imbalance = load.max(-1).values / load.mean(-1).clamp(min=1e-12)
            for router, ratio, mean_entropy in zip(self.routers, imbalance.tolist(), entropy.tolist()):
                metrics[f"moe/expert_load_max_over_mean/layer_{router.layer_number - 1}"] = ratio
                metrics[f"moe/router_entropy/layer_{router.layer_number - 1}"] = mean_entropy
        metrics = _merged_over_stages(metrics)
        per_layer = [(k, v) for k, v in metrics.items() if "/layer_" in k]
        loads = [v for k, v in per_layer if k.startswith("moe/expert_load")]
        entropies = [v for k, v in per_layer if k.startswith("moe/router_entropy")]
        if loads:
            metrics["moe/expert_load_max_over_mean"] = max(loads)
            metrics["moe/router_entropy"] = sum(entropies) / len(entropies)
        rows = {row: routing for row, routing in tally.rows.items() if row < len(lengths)}  # not the padding rows
        return RecordedRouting(rows, owner, lengths), metrics

    # --- the update -------------------------------------------------------------------------------------------
    def rows_for_update(self, recorded: RecordedRouting, first_row: int, plan: list[list[torch.Tensor]],
                        rows: int) -> dict[int, torch.Tensor]:
        """The recorded routing of the mini-batch rows [first_row, first_row + rows) this DP rank trains under
        `plan` (every DP rank's micro-batches, local row indices), fetched from the ranks that scored them."""
        from megatron.core import parallel_state

        needed = []
        for micro in plan:
            index = torch.cat(micro) if micro else torch.empty(0, dtype=torch.long)
            needed.append(sorted(first_row + i for i in index.tolist() if i < rows))
        if not self.routers:
            return {}
        group = parallel_state.get_data_parallel_group()
        return _exchange_rows(recorded, needed, group, (len(self.routers), self.top_k), self.dtype)

    @contextlib.contextmanager
    def updating(self, layout: PackedSequences | PackedRows, routing: list[torch.Tensor | None]) -> Iterator[None]:
        """Around one micro-batch's forward in the update: `routing` holds each of its sequences' recorded routing
        (None: a padding row). With R2 the routers replay it; either way the captured top-k is compared with it."""
        if not self.routers:
            yield
            return
        real = [piece if piece is not None else self._default(int(length))
                for piece, length in zip(routing, token_slots(layout)[1].tolist())]
        recorded = torch.cat(real).long()
        if self.replay:
            self._set_replay_targets(layout, recorded)
        with self._capturing(with_entropy=False):
            yield
            chosen, _ = self._gathered(layout)
        mask = torch.cat([torch.full((len(piece),), original is not None) for piece, original in zip(real, routing)])
        differs = (chosen[mask] != recorded[mask]).any(-1)
        self._tally.changed += int(differs.sum())
        self._tally.compared += int(differs.numel())

    def _default(self, tokens: int) -> torch.Tensor:
        """Routing for tokens nobody recorded (padding rows): experts 0..k-1 (any distinct ids; no loss reads them)."""
        return torch.arange(self.top_k, dtype=self.dtype).expand(tokens, len(self.routers), self.top_k)

    def _set_replay_targets(self, layout: PackedSequences | PackedRows, recorded: torch.Tensor) -> None:
        """Megatron's replay targets of each layer, [this rank's tokens, k], in the routers' token order."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        rows, width = layout.tokens_shape
        slots, _ = token_slots(layout)
        targets = torch.arange(self.top_k).repeat(len(self.routers), rows * width, 1)
        targets[:, slots] = recorded.permute(1, 0, 2)
        if self.model.config.sequence_parallel:
            tp = parallel_state.get_tensor_model_parallel_world_size()
            targets = targets.chunk(tp, dim=1)[parallel_state.get_tensor_model_parallel_rank()]
        for router, target in zip(self.routers, targets.to(platform.device())):
            router.router_replay.clear_indices()  # Megatron keeps every target for a backward replay we do not use
            router.router_replay.set_target_indices(target.contiguous())
            router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def finish_update(self) -> dict[str, float]:
        """Stop replaying; the update's share of changed routings (collective over DP and PP)."""
        from megatron.core import parallel_state

        for router in self.routers:
            if router.router_replay is not None:
                router.router_replay.clear_indices()
                router.router_replay.clear_router_replay_action()
        tally, self._tally = self._tally, _Tally()
        counts = _all_reduce(torch.tensor([float(tally.changed), float(tally.compared)]),
                             parallel_state.get_data_parallel_group())
        counts = _all_reduce(counts, parallel_state.get_pipeline_model_parallel_group())
        return {"moe/topk_changed_fraction": float(counts[0] / counts[1].clamp(min=1))}


def aux_loss_metrics(model_config: Any, names: list[str], num_microbatches: int) -> dict[str, float]:
    """The auxiliary losses Megatron's routers logged during an update (`names`, e.g. `load_balancing_loss`,
    `z_loss`), each summed over layers / MoE layers / micro-batches as Megatron reports it; collective over PP and
    the routers' groups. The tracker is cleared for the next update."""
    from megatron.core.transformer.moe import moe_utils

    if not names:
        return {}
    tracker = moe_utils.get_moe_layer_wise_logging_tracker()
    for name in names:  # a stage without MoE layers still takes part in the reductions over PP
        tracker.setdefault(name, {"values": torch.zeros(model_config.num_layers, device=platform.device()),
                                  "reduce_group": None, "avg_group": None, "reduce_group_has_dp": False})
    moe_utils.reduce_aux_losses_tracker_across_ranks(names)
    moe_layers = sum(model_config.moe_layer_freq) if isinstance(model_config.moe_layer_freq, list) else \
        model_config.num_layers
    metrics = {f"actor/moe_{name}": float(tracker[name]["values"].sum()) / moe_layers / max(num_microbatches, 1)
               for name in names}
    moe_utils.clear_aux_losses_tracker()
    return metrics


def _gather_tokens(tensor: torch.Tensor, group: Any) -> torch.Tensor:
    """[layers, tokens/TP, ...] from every TP rank -> [layers, tokens, ...] (each rank holds consecutive positions)."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, tensor.contiguous(), group=group)
    return torch.cat(pieces, dim=1)


def _all_reduce(values: torch.Tensor, group: Any) -> torch.Tensor:
    if dist.get_world_size(group) == 1:
        return values
    reduced = values.to(platform.device())  # NCCL reduces device tensors only
    dist.all_reduce(reduced, group=group)
    return reduced.cpu()


def _merged_over_stages(metrics: dict[str, float]) -> dict[str, float]:
    """Every pipeline stage's metrics (each stage measures its own layers), on every rank."""
    from megatron.core import parallel_state

    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        return metrics
    stages: list[dict[str, float]] = [{} for _ in range(parallel_state.get_pipeline_model_parallel_world_size())]
    dist.all_gather_object(stages, metrics, group=parallel_state.get_pipeline_model_parallel_group())
    return {key: value for stage in stages for key, value in stage.items()}


def _exchange_rows(recorded: RecordedRouting, needed: list[list[int]], group: Any, shape: tuple[int, int],
                   dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Send every recorded row to the DP rank that needs it (`needed[rank]`: rows, ascending) in one all-to-all;
    returns this rank's needed rows."""
    size, me = dist.get_world_size(group), dist.get_rank(group)
    if size == 1:
        return {row: recorded.rows[row] for row in needed[0]}
    per_token = shape[0] * shape[1]
    sending = [[row for row in needed[rank] if recorded.owner[row] == me] for rank in range(size)]
    receiving = [[row for row in needed[me] if recorded.owner[row] == rank] for rank in range(size)]
    tokens = recorded.lengths.tolist()
    send_sizes = [sum(tokens[row] for row in rows) * per_token for rows in sending]
    recv_sizes = [sum(tokens[row] for row in rows) * per_token for rows in receiving]
    outgoing = [recorded.rows[row].reshape(-1) for rows in sending for row in rows]
    send = torch.cat(outgoing) if outgoing else torch.empty(0, dtype=dtype)
    receive = torch.empty(sum(recv_sizes), dtype=dtype, device=platform.device())
    dist.all_to_all_single(receive, send.to(platform.device()), recv_sizes, send_sizes, group=group)
    ordered = [row for rows in receiving for row in rows]
    pieces = torch.split(receive.cpu(), [tokens[row] * per_token for row in ordered])
    return {row: piece.view(-1, *shape) for row, piece in zip(ordered, pieces)}
