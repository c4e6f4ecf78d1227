"""PPO's critic as every rank of the trainer runs it: a Megatron value model that scores each response token and
learns the returns of GAE.

The critic is the actor's architecture with a scalar head in place of the lm-head (`build_gpt_model(value_head=True)`,
models/value_head.py), started from `critic.model.path` (default the actor's model: a fresh head on the pretrained
decoder) and built in the actor's process groups with the actor's dtype, packing and activation recompute. It runs
over the batch as the actor does (megatron_model.py: Megatron's schedule, micro-batches or token budgets, rows split
over DP, results gathered on every rank). A response token's value is the head's output at the position that predicts
it (the prompt's last token for the first), as in verl. It trains under its own DDP wrapper, optimizer and schedule
(`critic.optim`), every step through its own `UpdateGuard` (a non-finite loss or gradient norm skips it on every rank,
`critic/update_skipped`), on verl's clipped value loss (algorithms/value_loss.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.algorithms.value_loss import value_loss
from megatron_cpo.models.builder import build_gpt_model, load_hf_config
from megatron_cpo.models.config import ModelConfig
from megatron_cpo.models.families import family_of
from megatron_cpo.models.weight_mapping import load_hf_weights
from megatron_cpo.trainer.batch.context_parallel import gather_positions
from megatron_cpo.trainer.batch.packing import PackedRows
from megatron_cpo.trainer.batch.sequences import PackedSequences
from megatron_cpo.trainer.config import ActorConfig
from megatron_cpo.trainer.critic_config import CriticConfig
from megatron_cpo.trainer.workers.megatron_model import MegatronModel, MicroBatch, with_zero_rows
from megatron_cpo.trainer.workers.optimizer import megatron_optimizer, wrap_ddp
from megatron_cpo.trainer.workers.policies import model_options
from megatron_cpo.trainer.workers.update_guard import FiniteProbe, UpdateGuard

SUMMED_METRICS = {"vf_loss", "vf_clipfrac", "vpred_mean"}  # each micro-batch's is its share of the mini-batch's


@dataclass(frozen=True, kw_only=True)
class ValueMicroBatch(MicroBatch):
    """One micro-batch of a critic update: its rows of the values before the update and of the returns, [rows, R]."""
    old_values: torch.Tensor
    returns: torch.Tensor


@dataclass(frozen=True)
class ValueLossStep:
    """The loss function of one critic update, called by Megatron's schedule for each micro-batch: verl's clipped
    value loss over the whole mini-batch's tokens / sequences, times `scale` (the schedule divides each micro-batch's
    loss by this rank's micro-batch count and DDP averages over DP); what it sees goes to `probe`."""
    config: CriticConfig
    probe: FiniteProbe
    global_tokens: float
    global_seqs: float
    scale: float

    def __call__(self, values: torch.Tensor, micro: ValueMicroBatch) -> tuple[torch.Tensor, dict]:
        device = values.device
        response_mask = micro.seqs.response_mask().to(device)
        self.probe.observe("values", values, response_mask)
        loss, metrics = value_loss(values, micro.old_values.to(device), micro.returns.to(device), response_mask,
                                   self.config.cliprange_value, self.config.loss_agg_mode, self.global_tokens,
                                   self.global_seqs)
        self.probe.observe("loss", loss)
        return loss * self.scale, metrics


class MegatronCritic(MegatronModel):
    """The value model of this rank (its TP slice / PP stage) with its DDP wrapper, optimizer and schedule; `config`
    is the `critic` section as it is (micro-batches, token budgets, the value loss)."""

    def __init__(self, model: Any, pad_token_id: int, config: CriticConfig, ddp_model: Any, optimizer: Any,
                 scheduler: Any, use_remove_padding: bool = False) -> None:
        super().__init__(model, pad_token_id, config, ddp_model, optimizer, scheduler, use_fused_kernels=False,
                         use_remove_padding=use_remove_padding)
        self.guard = UpdateGuard("critic", config.max_consecutive_skipped_updates,
                                 "critic.max_consecutive_skipped_updates")

    def _token_values(self, output: torch.Tensor, layout: PackedSequences | PackedRows) -> tuple[torch.Tensor]:
        """The last stage's `[b, s, 1]` values (this CP rank's chunks of each row) -> response-aligned [rows, R]."""
        from megatron.core import parallel_state

        values = output.squeeze(-1).float()
        if self._cp_size() > 1:
            values = gather_positions(values, layout.length, parallel_state.get_context_parallel_group())
        return (layout.to_response(values),)

    @torch.no_grad()
    def values(self, seqs: PackedSequences) -> torch.Tensor:
        """The value of every response token, [rows, R] float32 (0 off the response mask), on every rank."""
        self._module.eval()
        config = self.config
        padded, plan = self._plan(seqs, config.scoring_token_budget, "critic.forward_max_token_len_per_gpu",
                                  config.ppo_micro_batch_size_per_gpu)
        outputs = self._run(self._micro_batches(padded, plan), self._token_values,
                            lambda values, batch: (torch.zeros((), device=values.device), (values,)),
                            forward_only=True)
        return self._gather_rows(outputs, plan, padded.rows, seqs, count=1)[0]

    def update(self, seqs: PackedSequences, old_values: torch.Tensor, returns: torch.Tensor,
               probe: FiniteProbe | None = None) -> dict[str, float]:
        """One optimizer step on `seqs` (a mini-batch) towards `returns`, the value loss clipped around `old_values`
        ([rows, R] each); skipped on every rank when the loss or the gradient norm is not finite on any."""
        metrics, probe = self.accumulate_gradients(seqs, old_values, returns, probe)
        self.scheduler.step(increment=1)
        updated, grad_norm = self.guard.step(self.optimizer, probe)
        metrics.update({"critic/grad_norm": grad_norm, "critic/lr": self.optimizer.param_groups[0]["lr"],
                        "critic/update_skipped": float(not updated)})
        return metrics

    def accumulate_gradients(self, seqs: PackedSequences, old_values: torch.Tensor, returns: torch.Tensor,
                             probe: FiniteProbe | None = None) -> tuple[dict[str, float], FiniteProbe]:
        """The forward and backward passes of `update`: the mini-batch's value-loss gradient in the DDP buffers
        (reduced over DP; `main_grad` of every parameter), its metrics on every rank, and the probe that saw it."""
        from megatron.core import parallel_state

        config = self.config
        mask = seqs.response_mask()
        global_tokens = float(mask.sum().clamp(min=1))
        global_seqs = float((mask.sum(-1) > 0).sum().clamp(min=1))
        padded, plan = self._plan(seqs, config.ppo_max_token_len_per_gpu, "critic.ppo_max_token_len_per_gpu",
                                  config.ppo_micro_batch_size_per_gpu)
        old_values, returns = with_zero_rows(old_values, padded.rows), with_zero_rows(returns, padded.rows)
        micro = [ValueMicroBatch(rows=m.rows, seqs=m.seqs, packed=m.packed, old_values=old_values[m.rows],
                                 returns=returns[m.rows]) for m in self._micro_batches(padded, plan)]
        probe = probe.for_update() if probe is not None else FiniteProbe()
        loss_step = ValueLossStep(config, probe, global_tokens, global_seqs,
                                  len(micro) * parallel_state.get_data_parallel_world_size())
        self._module.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, self._token_values, loss_step, forward_only=False)
        return self._reduce_metrics(outputs, SUMMED_METRICS, "critic"), probe


def build_critic(model_cfg: ModelConfig, actor_cfg: ActorConfig, critic_cfg: CriticConfig, pad_token_id: int,
                 total_updates: int) -> MegatronCritic:
    """The critic of a run with `algorithm.adv_estimator=gae` (every rank, after `init_distributed`): the value model
    of `critic.model.path` (or the actor's `model.path`) in the actor's layout, dtype and recompute
    (`actor.megatron`, `model.enable_gradient_checkpointing`), packing (`model.use_remove_padding`) and the MoE
    knobs of a mixture of experts; its own DDP wrapper and optimizer; `total_updates` (steps x critic epochs x
    mini-batches) sizes its learning-rate schedule."""
    path = critic_cfg.model.path or model_cfg.path
    hf_config = load_hf_config(path)
    moe = family_of(hf_config).moe(hf_config) is not None
    megatron = actor_cfg.megatron
    model = build_gpt_model(hf_config, params_dtype=getattr(torch, megatron.compute_dtype), value_head=True,
                            **model_options(megatron, model_cfg.enable_gradient_checkpointing, moe))
    load_hf_weights(model, path)
    ddp_model = wrap_ddp(model, critic_cfg.megatron.use_distributed_optimizer)
    optimizer, scheduler = megatron_optimizer(ddp_model, critic_cfg.optim, megatron.compute_dtype,
                                              critic_cfg.megatron.use_distributed_optimizer, total_updates)
    return MegatronCritic(model, pad_token_id, critic_cfg, ddp_model, optimizer, scheduler,
                          model_cfg.use_remove_padding)
