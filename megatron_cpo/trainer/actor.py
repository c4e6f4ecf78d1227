"""The Megatron actor and its frozen reference, as every rank of the trainer runs them.

Both are `GPTModel`s built from the HF config (TP x PP from `parallel_state`). The actor trains under Megatron DDP and
the (distributed) optimizer; the reference only scores. Every forward goes through Megatron's
`get_forward_backward_func`, so pipeline parallelism works unchanged, and every log-prob / entropy comes from the
fused kernel on the vocab-parallel logits, with the padded vocabulary columns left out of the softmax.

Rows are split over the data-parallel ranks; each rank computes its share and the per-token results are gathered, so
every rank ends with the whole batch's tensors (the advantage math then runs identically everywhere).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.algorithms.losses import PolicyLossConfig, policy_loss
from megatron_cpo.kernels import logprobs_and_entropy
from megatron_cpo.trainer.sequences import IGNORE_INDEX, PackedSequences


@dataclass
class UpdateInputs:
    """Per-token tensors [rows, R] of one batch for the PPO update (response-aligned)."""
    advantages: torch.Tensor
    old_log_probs: torch.Tensor
    ref_log_probs: torch.Tensor | None
    rollout_log_probs: torch.Tensor | None


def _pad_rows(seqs: PackedSequences, multiple: int, pad_token_id: int) -> PackedSequences:
    """Append empty rows (no response tokens) so the row count is a multiple of `multiple`."""
    extra = (-seqs.rows) % multiple
    if not extra:
        return seqs
    return PackedSequences(
        torch.cat([seqs.tokens, torch.full((extra, seqs.length), pad_token_id, dtype=torch.long)]),
        torch.cat([seqs.targets, torch.full((extra, seqs.length), IGNORE_INDEX, dtype=torch.long)]),
        torch.cat([seqs.prompt_lengths, torch.ones(extra, dtype=torch.long)]),
        torch.cat([seqs.response_lengths, torch.zeros(extra, dtype=torch.long)]),
        seqs.response_width)


class MegatronPolicy:
    """One Megatron model (this rank's TP slice / PP stage) with forward-only scoring and, if trainable, updates."""

    def __init__(self, model: Any, pad_token_id: int, micro_batch_size: int, ddp_model: Any = None,
                 optimizer: Any = None, scheduler: Any = None, log_prob_micro_batch_size: int = 0) -> None:
        self.model = model
        self.ddp_model = ddp_model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.log_prob_micro_batch_size = log_prob_micro_batch_size or micro_batch_size  # forward-only scoring

    @property
    def _module(self) -> Any:
        return self.ddp_model if self.ddp_model is not None else self.model

    def _run(self, micro_batches: list[dict], length: int, step_fn: Callable, forward_only: bool,
             micro_size: int) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        positions = torch.arange(length, device=platform.device()).unsqueeze(0)

        def forward_step(data_iterator, stage_model):
            batch = next(data_iterator)
            tokens = batch["seqs"].tokens.to(platform.device())
            output = stage_model(tokens, positions.expand_as(tokens), attention_mask=None)
            return output, lambda logits: step_fn(logits, batch)

        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches), model=[self._module],
            num_microbatches=len(micro_batches), seq_length=length, micro_batch_size=micro_size,
            forward_only=forward_only)

    def _log_probs_entropy(self, logits: torch.Tensor, seqs: PackedSequences, temperature: float
                           ) -> tuple[torch.Tensor, torch.Tensor]:
        from megatron.core import parallel_state

        tp_group = parallel_state.get_tensor_model_parallel_group()
        log_probs, entropy = logprobs_and_entropy(
            logits, seqs.targets.to(logits.device), temperature=temperature,
            tp_group=tp_group if parallel_state.get_tensor_model_parallel_world_size() > 1 else None,
            ignore_index=IGNORE_INDEX, vocab_size=self.model.hf_vocab_size)
        return seqs.to_response(log_probs), seqs.to_response(entropy)

    def _split(self, seqs: PackedSequences, micro_size: int, extra: dict[str, torch.Tensor] | None = None
               ) -> tuple[list[dict], int]:
        """This DP rank's rows of `seqs`, padded and cut into micro-batches; returns them and the padded row count."""
        from megatron.core import parallel_state

        dp_size = parallel_state.get_data_parallel_world_size()
        dp_rank = parallel_state.get_data_parallel_rank()
        padded = _pad_rows(seqs, dp_size * micro_size, self.pad_token_id)
        per_rank = padded.rows // dp_size
        rows = torch.arange(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        micro = []
        for start in range(0, per_rank, micro_size):
            index = rows[start: start + micro_size]
            batch = {"seqs": padded.select(index)}
            for name, tensor in (extra or {}).items():
                full = torch.cat([tensor, torch.zeros((padded.rows - tensor.shape[0], *tensor.shape[1:]),
                                                      dtype=tensor.dtype)])
                batch[name] = full[index]
            micro.append(batch)
        return micro, padded.rows

    @torch.no_grad()
    def log_probs(self, seqs: PackedSequences, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-prob and entropy of every response token, [rows, R] float32 each, on every rank."""
        from megatron.core import parallel_state

        self._module.eval()
        micro, padded_rows = self._split(seqs, self.log_prob_micro_batch_size)
        outputs = self._run(micro, seqs.length,
                            lambda logits, batch: (torch.zeros((), device=logits.device),
                                                   self._log_probs_entropy(logits, batch["seqs"], temperature)),
                            forward_only=True, micro_size=self.log_prob_micro_batch_size)
        width = seqs.response_width
        local_rows = padded_rows // parallel_state.get_data_parallel_world_size()
        local = torch.zeros(2, local_rows, width, device=platform.device())
        if parallel_state.is_pipeline_last_stage():
            local[0] = torch.cat([lp for lp, _ in outputs]).to(local.device)
            local[1] = torch.cat([ent for _, ent in outputs]).to(local.device)
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(local, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
        pieces = [torch.empty_like(local) for _ in range(parallel_state.get_data_parallel_world_size())]
        dist.all_gather(pieces, local, group=parallel_state.get_data_parallel_group())
        full = torch.cat(pieces, dim=1)[:, : seqs.rows].cpu()
        return full[0], full[1]

    def update(self, seqs: PackedSequences, inputs: UpdateInputs, loss_config: PolicyLossConfig, temperature: float
               ) -> dict[str, float]:
        """One optimizer step on `seqs` (a mini-batch): forward/backward over micro-batches, clip, Adam, schedule.

        The loss is aggregated over the whole mini-batch (all micro-batches and DP ranks), so the update does not
        depend on how the mini-batch is split.
        """
        from megatron.core import parallel_state

        mask = seqs.response_mask()
        global_tokens = float(mask.sum().clamp(min=1))
        global_seqs = float((mask.sum(-1) > 0).sum().clamp(min=1))
        extra = {"advantages": inputs.advantages, "old_log_probs": inputs.old_log_probs}
        if inputs.ref_log_probs is not None:
            extra["ref_log_probs"] = inputs.ref_log_probs
        if inputs.rollout_log_probs is not None:
            extra["rollout_log_probs"] = inputs.rollout_log_probs
        micro, _ = self._split(seqs, self.micro_batch_size, extra)
        scale = len(micro) * parallel_state.get_data_parallel_world_size()

        def loss_step(logits, batch):
            log_probs, entropy = self._log_probs_entropy(logits, batch["seqs"], temperature)
            device = log_probs.device
            loss, metrics = policy_loss(
                log_probs, batch["old_log_probs"].to(device), batch["advantages"].to(device),
                batch["seqs"].response_mask().to(device), loss_config, entropy=entropy,
                ref_log_probs=batch["ref_log_probs"].to(device) if "ref_log_probs" in batch else None,
                rollout_log_probs=batch["rollout_log_probs"].to(device) if "rollout_log_probs" in batch else None,
                global_tokens=global_tokens, global_seqs=global_seqs)
            return loss * scale, {k: torch.tensor(float(v)) for k, v in metrics.items()}

        self._module.train()
        self.ddp_model.zero_grad_buffer()
        self.optimizer.zero_grad()
        outputs = self._run(micro, seqs.length, loss_step, forward_only=False, micro_size=self.micro_batch_size)
        self.scheduler.step(increment=1)
        updated, grad_norm, _ = self.optimizer.step()
        metrics = self._reduce_metrics(outputs)
        metrics.update({"actor/grad_norm": float(grad_norm or 0.0), "actor/lr": self.optimizer.param_groups[0]["lr"],
                        "actor/update_skipped": float(not updated)})
        return metrics

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
