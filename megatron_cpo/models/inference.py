"""Forward passes and greedy generation with a (TP/PP-sharded) Megatron model, for checks and the CLI.

These run the whole sequence through Megatron's own pipeline schedule on every step (no KV cache): they exist to check
a converted model and to eyeball its text, not to serve it; rollouts use vLLM.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from megatron_cpo import platform


@torch.no_grad()
def forward_logits(model: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """Logits over the real vocabulary, [batch, seq, hf_vocab_size] float, on the last PP stage (None elsewhere).

    Every rank of the model-parallel group must call it with the same `input_ids` ([batch, seq] token ids). The
    causal mask is Megatron's default; padding tokens are ordinary tokens here.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    model.eval()
    tokens = input_ids.to(platform.device())
    positions = torch.arange(tokens.shape[1], device=tokens.device).unsqueeze(0).expand_as(tokens)

    def gather_logits(vocab_parallel_logits: torch.Tensor, non_loss_data: bool = True) -> torch.Tensor:
        full = tensor_parallel.gather_from_tensor_model_parallel_region(vocab_parallel_logits)
        return full[..., : model.hf_vocab_size].float()

    def forward_step(data_iterator, stage_model):
        batch_tokens = next(data_iterator)
        return stage_model(batch_tokens, positions, attention_mask=None), gather_logits

    outputs = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter([tokens]),
        model=[model],
        num_microbatches=1,
        seq_length=tokens.shape[1],
        micro_batch_size=tokens.shape[0],
        forward_only=True,
        collect_non_loss_data=True,
    )
    return outputs[0] if parallel_state.is_pipeline_last_stage() else None


@torch.no_grad()
def greedy_generate(model: Any, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> list[int]:
    """Greedily extend `prompt_ids` by up to `max_new_tokens` tokens (stopping at EOS); returns the new tokens.

    Collective over the model-parallel group: the last stage picks each token and broadcasts it to the other stages.
    """
    from megatron.core import parallel_state

    tokens = list(prompt_ids)
    new_tokens: list[int] = []
    last_stage_rank = parallel_state.get_pipeline_model_parallel_last_rank()
    for _ in range(max_new_tokens):
        logits = forward_logits(model, torch.tensor([tokens]))
        next_token = torch.zeros(1, dtype=torch.long, device=platform.device())
        if logits is not None:
            next_token[0] = logits[0, -1].argmax()
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            dist.broadcast(next_token, src=last_stage_rank, group=parallel_state.get_pipeline_model_parallel_group())
        token = int(next_token.item())
        tokens.append(token)
        new_tokens.append(token)
        if token == eos_token_id:
            break
    return new_tokens
