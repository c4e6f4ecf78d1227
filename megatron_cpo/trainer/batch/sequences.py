"""Prompt + response token sequences for Megatron, and the map from positions to response tokens.

Rows are kept ragged and padded per micro-batch on demand; `targets` holds each response token at the position
that predicts it and `IGNORE_INDEX` elsewhere. `response_mask` is the one mask every masked quantity uses (times
a multi-turn episode's `loss_mask`). docs/trainer.md, "Sequences and micro-batches".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.trainer.batch.ragged import RaggedRows

IGNORE_INDEX = -100


@dataclass
class PackedSequences:
    prompts: RaggedRows    # prompt token ids per row
    responses: RaggedRows  # response token ids per row
    length: int            # L, the padded length of `tokens` / `targets`
    response_width: int    # R, the response-aligned width
    pad_token_id: int = 0
    loss_mask: RaggedRows | None = None  # per response token: 1 sampled, 0 observation (None: all sampled)

    @property
    def rows(self) -> int:
        return self.prompts.rows

    @property
    def prompt_lengths(self) -> torch.Tensor:
        """[rows] long."""
        return self.prompts.lengths()

    @property
    def response_lengths(self) -> torch.Tensor:
        """[rows] long."""
        return self.responses.lengths()

    @property
    def tokens(self) -> torch.Tensor:
        """[rows, L] long: prompt, response, then padding."""
        tokens = torch.full((self.rows, self.length), self.pad_token_id, dtype=torch.long)
        tokens.masked_scatter_(self.prompts.within(self.length), self.prompts.values)
        return tokens.masked_scatter_(self.responses.within(self.length, self.prompt_lengths), self.responses.values)

    @property
    def targets(self) -> torch.Tensor:
        """[rows, L] long: response token j at position prompt_len + j - 1 (the one that predicts it), IGNORE_INDEX
        elsewhere."""
        targets = torch.full((self.rows, self.length), IGNORE_INDEX, dtype=torch.long)
        return targets.masked_scatter_(self.responses.within(self.length, self.prompt_lengths - 1),
                                       self.responses.values)

    @property
    def tokens_shape(self) -> tuple[int, int]:
        """(rows, L): the shape of `tokens`, without building it."""
        return self.rows, self.length

    def response_mask(self) -> torch.Tensor:
        """[rows, R] float, 1 on real response tokens the policy sampled (0 on padding and observation tokens)."""
        if self.loss_mask is not None:
            return self.loss_mask.padded(self.response_width, 0).float()
        steps = torch.arange(self.response_width)
        return (steps[None, :] < self.response_lengths[:, None]).float()

    def to_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Gather a [rows, L] per-position tensor (indexed by the predicting position) into [rows, R]."""
        steps = torch.arange(self.response_width, device=per_position.device)
        index = (self.prompt_lengths.to(per_position.device)[:, None] - 1 + steps[None, :])
        index = index.clamp(0, self.length - 1)
        gathered = per_position.gather(1, index)
        return gathered * self.response_mask().to(gathered.device, gathered.dtype)

    def lengths(self) -> torch.Tensor:
        """[rows] long, prompt + response tokens of each row (its length before right padding)."""
        return self.prompt_lengths + self.response_lengths

    def trimmed(self) -> PackedSequences:
        """The same rows padded only to their own longest row (a micro-batch padded only as far as it needs)."""
        return PackedSequences(self.prompts, self.responses, int(self.lengths().max()), self.response_width,
                               self.pad_token_id, self.loss_mask)

    def select(self, rows: torch.Tensor | slice) -> PackedSequences:
        """The given rows (index tensor or slice), at the same padded length."""
        index = torch.arange(self.rows)[rows] if isinstance(rows, slice) else rows
        return PackedSequences(self.prompts.select(index), self.responses.select(index), self.length,
                               self.response_width, self.pad_token_id,
                               self.loss_mask.select(index) if self.loss_mask is not None else None)

    def with_empty_rows(self, extra: int) -> PackedSequences:
        """`extra` rows appended with a one-token (padding) prompt and no response: they add nothing to any loss."""
        prompts = RaggedRows(torch.cat([self.prompts.values, torch.full((extra,), self.pad_token_id)]),
                             torch.cat([self.prompts.offsets, self.prompts.offsets[-1] + torch.arange(1, extra + 1)]))
        responses = RaggedRows(self.responses.values,
                               torch.cat([self.responses.offsets, self.responses.offsets[-1].repeat(extra)]))
        loss_mask = (RaggedRows(self.loss_mask.values, responses.offsets) if self.loss_mask is not None else None)
        return PackedSequences(prompts, responses, self.length, self.response_width, self.pad_token_id, loss_mask)


def pack_sequences(prompts: RaggedRows | list[list[int]], responses: RaggedRows | list[list[int]], pad_token_id: int,
                   response_width: int, loss_mask: RaggedRows | None = None) -> PackedSequences:
    """Prompt/response token rows (same count; ragged tensors or lists) as sequences padded to the longest row;
    `loss_mask` (one value per response token) marks the tokens the losses count.

    Only the lengths are checked here; the padded tensors are built per micro-batch (`tokens`, `targets`).
    """
    prompts, responses = RaggedRows.of(prompts), RaggedRows.of(responses)
    if prompts.rows != responses.rows:
        raise ValueError(f"{prompts.rows} prompts but {responses.rows} responses; pass one prompt per response")
    if loss_mask is not None and not torch.equal(loss_mask.offsets, responses.offsets):
        raise ValueError("the loss mask's rows do not match the responses' (one mask value per response token)")
    prompt_lengths, response_lengths = prompts.lengths(), responses.lengths()
    if int(prompt_lengths.min()) < 1:
        raise ValueError("an empty prompt cannot predict its first response token; every prompt needs >= 1 token")
    if int(response_lengths.max()) > response_width:
        raise ValueError(f"a response has {int(response_lengths.max())} tokens, more than the response width "
                         f"{response_width} (data.max_response_length); the rollout must cap max_tokens at it")
    return PackedSequences(prompts, responses, int((prompt_lengths + response_lengths).max()), response_width,
                           pad_token_id, loss_mask)
