"""Prompt + response token sequences packed for Megatron, and the map from positions to response tokens.

Each row is `prompt tokens + response tokens`, right-padded to a common length. The causal mask makes right padding
harmless. Response token j of row b sits at position `prompt_len[b] + j` and is predicted by the logits at
`prompt_len[b] + j - 1`; `targets` holds that token at that position and `IGNORE_INDEX` everywhere else, so the
log-prob kernel skips prompt and padding positions. `to_response` gathers per-position values into the
response-aligned `[rows, max_response_length]` layout the algorithms use.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_cpo.trainer.ragged import RaggedRows

IGNORE_INDEX = -100


@dataclass
class PackedSequences:
    tokens: torch.Tensor          # [rows, L] long
    targets: torch.Tensor         # [rows, L] long, IGNORE_INDEX off the response
    prompt_lengths: torch.Tensor  # [rows] long
    response_lengths: torch.Tensor  # [rows] long
    response_width: int           # R, the response-aligned width

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def length(self) -> int:
        return self.tokens.shape[1]

    def response_mask(self) -> torch.Tensor:
        """[rows, R] float, 1 on real response tokens."""
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

    def trimmed(self) -> "PackedSequences":
        """The same rows cut to their own longest row (a micro-batch padded only as far as it needs)."""
        length = int(self.lengths().max())
        return PackedSequences(self.tokens[:, :length], self.targets[:, :length], self.prompt_lengths,
                               self.response_lengths, self.response_width)

    def select(self, rows: torch.Tensor | slice) -> "PackedSequences":
        return PackedSequences(self.tokens[rows], self.targets[rows], self.prompt_lengths[rows],
                               self.response_lengths[rows], self.response_width)


def pack_sequences(prompts: RaggedRows | list[list[int]], responses: RaggedRows | list[list[int]], pad_token_id: int,
                   response_width: int) -> PackedSequences:
    """Pack prompt/response token rows (same count; ragged tensors or lists) into right-padded tensors with response
    targets, vectorised: each ragged tensor is scattered once through a mask, no Python loop over rows."""
    prompts, responses = RaggedRows.of(prompts), RaggedRows.of(responses)
    if prompts.rows != responses.rows:
        raise ValueError(f"{prompts.rows} prompts but {responses.rows} responses; pass one prompt per response")
    prompt_lengths, response_lengths = prompts.lengths(), responses.lengths()
    if int(prompt_lengths.min()) < 1:
        raise ValueError("an empty prompt cannot predict its first response token; every prompt needs >= 1 token")
    if int(response_lengths.max()) > response_width:
        raise ValueError(f"a response has {int(response_lengths.max())} tokens, more than the response width "
                         f"{response_width} (data.max_response_length); the rollout must cap max_tokens at it")
    length = int((prompt_lengths + response_lengths).max())
    tokens = torch.full((prompts.rows, length), pad_token_id, dtype=torch.long)
    tokens.masked_scatter_(prompts.within(length), prompts.values)
    on_response = responses.within(length, prompt_lengths)
    tokens.masked_scatter_(on_response, responses.values)
    targets = torch.full_like(tokens, IGNORE_INDEX)
    # response token j is predicted at position prompt_len + j - 1: one column left of where it sits
    targets[:, :-1].masked_scatter_(on_response[:, 1:], responses.values)
    return PackedSequences(tokens, targets, prompt_lengths, response_lengths, response_width)
