"""Variable-length rows as one flat tensor and offsets: how token and log-prob rows travel between ranks.

A list of Python lists is pickled element by element (the issue measured ~8 s per DAPO-sized step for the lists'
broadcast, packing and padding); a flat tensor is one buffer. Conversion from the engine's lists goes through
`numpy.fromiter`, the one pass over the Python objects that cannot be avoided; everything after is vectorised.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

_NUMPY_DTYPES = {torch.long: np.int64, torch.float32: np.float32}


@dataclass
class RaggedRows:
    """Row i is `values[offsets[i]:offsets[i + 1]]`; `offsets` is [rows + 1] long and starts at 0."""
    values: torch.Tensor
    offsets: torch.Tensor

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[float]], dtype: torch.dtype = torch.long) -> RaggedRows:
        """Flatten Python rows (token ids, or log-probs with dtype=torch.float32)."""
        if dtype not in _NUMPY_DTYPES:
            raise ValueError(f"dtype={dtype} is not supported; use torch.long or torch.float32")
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        offsets = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.fromiter(chain.from_iterable(rows), dtype=_NUMPY_DTYPES[dtype], count=int(offsets[-1]))
        return cls(torch.from_numpy(values), torch.from_numpy(offsets))

    @classmethod
    def of(cls, rows: RaggedRows | Sequence[Sequence[float]], dtype: torch.dtype = torch.long) -> RaggedRows:
        """`rows` itself when already ragged, else `from_lists(rows, dtype)`."""
        return rows if isinstance(rows, RaggedRows) else cls.from_lists(rows, dtype)

    @property
    def rows(self) -> int:
        return self.offsets.numel() - 1

    def lengths(self) -> torch.Tensor:
        """[rows] long."""
        return self.offsets[1:] - self.offsets[:-1]

    def within(self, width: int, start: torch.Tensor | int = 0) -> torch.Tensor:
        """[rows, width] bool, True at columns `start[i] .. start[i] + len(row i) - 1`: in row-major order these are
        exactly `values`, so `out.masked_scatter_(rows.within(width, start), rows.values)` places every row."""
        start = torch.as_tensor(start)
        columns = torch.arange(width)
        start = start[:, None] if start.dim() else start
        return (columns >= start) & (columns < start + self.lengths()[:, None])

    def padded(self, width: int, fill: float = 0) -> torch.Tensor:
        """[rows, width] right-padded with `fill` (every row must fit in `width`)."""
        if self.rows and int(self.lengths().max()) > width:
            raise ValueError(f"a row of {int(self.lengths().max())} values does not fit the width {width}")
        return torch.full((self.rows, width), fill, dtype=self.values.dtype).masked_scatter_(
            self.within(width), self.values)

    def select(self, rows: torch.Tensor) -> RaggedRows:
        """The given rows (a long index tensor), in that order."""
        lengths = self.lengths()[rows]
        offsets = torch.zeros(len(rows) + 1, dtype=torch.long)
        torch.cumsum(lengths, 0, out=offsets[1:])
        within = torch.arange(int(offsets[-1])) - offsets[:-1].repeat_interleave(lengths)
        return RaggedRows(self.values[self.offsets[:-1][rows].repeat_interleave(lengths) + within], offsets)

    def repeat_rows(self, counts: Sequence[int]) -> RaggedRows:
        """Row i repeated `counts[i]` times, in place (one tile per row: a group's prompt for each of its samples)."""
        values, bounds = self.values.numpy(), self.offsets.tolist()
        lengths = np.repeat(np.diff(self.offsets.numpy()), counts)
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        tiles = [np.tile(values[start:end], count) for start, end, count in zip(bounds[:-1], bounds[1:], counts)]
        flat = np.concatenate(tiles) if tiles else values[:0]
        return RaggedRows(torch.from_numpy(flat), torch.from_numpy(offsets))

    @classmethod
    def cat(cls, parts: Sequence[RaggedRows]) -> RaggedRows:
        """The rows of `parts`, one after another (one concatenation of the values, offsets shifted)."""
        # numpy's single-threaded copy: torch.cat's thread pool stalls on a loaded machine (seconds, measured)
        lengths = np.concatenate([np.diff(part.offsets.numpy()) for part in parts])
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        values = np.concatenate([part.values.numpy() for part in parts])
        return cls(torch.from_numpy(values), torch.from_numpy(offsets))

    def tolist(self) -> list[list]:
        values = self.values.tolist()
        bounds = self.offsets.tolist()
        return [values[start:end] for start, end in zip(bounds[:-1], bounds[1:])]
