"""Padding-free packing (`actor_rollout_ref.model.use_remove_padding`): several sequences per row of a micro-batch.

A micro-batch's prompt + response sequences are laid end to end in rows; position ids restart at 0 for every
sequence and attention stays inside each sequence, so every sequence is computed exactly as it would be alone in a
right-padded row, without the padding. Two layouts of the same idea:
- `rows` (Megatron-Core's local attention, `attention_backend=local`): sequences are bin-packed, longest first, into
  rows as wide as the longest sequence, and the attention gets a per-sequence block-diagonal causal mask
  `[rows, 1, W, W]`; the rotary embedding is taken at each token's own position id
  (`models.builder.decoder_hidden_states`);
- `thd` (Transformer Engine's or torch's fused attention, models/attention.py): every sequence in one row `[1, T]`,
  described by `PackedSeqParams` (cumulative sequence lengths), so the variable-length (or per-sequence) attention never
  sees another sequence or any padding and RoPE restarts per sequence. The tail is padded to `multiple` tokens (sequence
  parallelism splits the row over TP ranks) and the padding forms one more (ignored) sequence, so the lengths cover the
  row.

Per-position results (log-probs, entropy) are gathered back into the response-aligned `[sequences, R]` layout by
`to_response`, the same layout the padded path gives.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, PackedSequences

LAYOUTS = ("rows", "thd")


def first_fit_rows(lengths: list[int], width: int) -> list[list[int]]:
    """Sequence indices bin-packed (first fit, longest first) into rows of `width` tokens; every length <= width."""
    rows: list[list[int]] = []
    free: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for row, space in enumerate(free):
            if lengths[index] <= space:
                rows[row].append(index)
                free[row] -= lengths[index]
                break
        else:
            rows.append([index])
            free.append(width - lengths[index])
    return rows


@dataclass
class PackedRows:
    """A micro-batch packed several sequences per row. `segments` numbers each token's sequence (-1 on padding);
    `starts` is the flat index (row x W + column) of each sequence's first token."""
    tokens: torch.Tensor     # [rows, W] long
    positions: torch.Tensor  # [rows, W] long, restarting at 0 per sequence
    segments: torch.Tensor   # [rows, W] long
    targets: torch.Tensor    # [rows, W] long, IGNORE_INDEX off the response predictions
    starts: torch.Tensor     # [sequences] long
    layout: str
    seqs: PackedSequences    # the unpacked sequences (response-aligned shapes and masks)

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def tokens_shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def attention_mask(self, device: Any = None) -> torch.Tensor:
        """[rows, 1, W, W] bool, True where attention is not allowed (Megatron's convention): a query sees only the
        earlier tokens of its own sequence (padding sees padding, and nothing reads it)."""
        segments = self.segments.to(device)
        columns = torch.arange(self.width, device=segments.device)
        causal = columns[None, :] <= columns[:, None]
        same = segments[:, :, None] == segments[:, None, :]
        return ~(same & causal)[:, None]

    def packed_seq_params(self, device: Any = None) -> Any:
        """Megatron's `PackedSeqParams` (THD) for the `thd` layout: cumulative lengths of the sequences (the tail
        padding included as one more sequence so they cover the row)."""
        from megatron.core.packed_seq_params import PackedSeqParams

        lengths = self.seqs.lengths()
        tail = self.width - int(lengths.sum())
        lengths = torch.cat([lengths, torch.tensor([tail])]) if tail else lengths
        cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32)
        torch.cumsum(lengths, 0, out=cu_seqlens[1:])
        cu_seqlens = cu_seqlens.to(device)
        longest = int(lengths.max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                               max_seqlen_q=longest, max_seqlen_kv=longest)

    def to_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Gather a `[rows, W]` per-position tensor (indexed by the predicting position) into `[sequences, R]`."""
        steps = torch.arange(self.seqs.response_width, device=per_position.device)
        first = (self.starts + self.seqs.prompt_lengths - 1).to(per_position.device)
        index = (first[:, None] + steps[None, :]).clamp(max=per_position.numel() - 1)
        gathered = per_position.reshape(-1)[index]
        return gathered * self.seqs.response_mask().to(gathered.device, gathered.dtype)


def pack_rows(seqs: PackedSequences, layout: str = "rows", multiple: int = 1) -> PackedRows:
    """`seqs` packed in the given layout (`rows`: bin-packed rows as wide as the longest sequence; `thd`: one row),
    the width padded to a multiple of `multiple` tokens (sequence parallelism splits rows over the TP ranks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"packing layout {layout!r} is unknown; choose from {list(LAYOUTS)}")
    lengths = seqs.lengths()
    if layout == "rows":
        width = int(lengths.max())
        assignment = first_fit_rows(lengths.tolist(), width)
    else:
        width = int(lengths.sum())
        assignment = [list(range(seqs.rows))]
    width = -(-width // multiple) * multiple
    order = torch.tensor([index for row in assignment for index in row], dtype=torch.long)
    row_of = torch.empty(seqs.rows, dtype=torch.long)
    row_of[order] = torch.repeat_interleave(torch.arange(len(assignment)), torch.tensor([len(r) for r in assignment]))
    # a sequence's column: the lengths of the sequences before it in its row (the order above, row by row)
    ordered_lengths = lengths[order]
    before = torch.cumsum(ordered_lengths, 0) - ordered_lengths
    row_tokens = torch.tensor([int(lengths[row].sum()) for row in assignment])
    row_start = torch.cumsum(row_tokens, 0) - row_tokens
    column = torch.empty(seqs.rows, dtype=torch.long)
    column[order] = before - row_start[row_of[order]]
    starts = row_of * width + column

    count = int(lengths.sum())
    owner = torch.repeat_interleave(torch.arange(seqs.rows), lengths)           # sequence of each real token
    offset = torch.arange(count) - torch.repeat_interleave(torch.cumsum(lengths, 0) - lengths, lengths)
    flat = starts[owner] + offset                                              # its flat position in the rows
    size = len(assignment) * width
    tokens = torch.full((size,), seqs.pad_token_id, dtype=torch.long)
    real = torch.arange(seqs.length)[None, :] < lengths[:, None]                # prompt + response, row-major
    tokens[flat] = seqs.tokens[real]
    positions = torch.zeros(size, dtype=torch.long)
    positions[flat] = offset
    segments = torch.full((size,), -1, dtype=torch.long)
    segments[flat] = owner
    targets = torch.full((size,), IGNORE_INDEX, dtype=torch.long)
    targets[flat] = seqs.targets[real]
    shape = (len(assignment), width)
    return PackedRows(tokens.view(shape), positions.view(shape), segments.view(shape), targets.view(shape), starts,
                      layout, seqs)
