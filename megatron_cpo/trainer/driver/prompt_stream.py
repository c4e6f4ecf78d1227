"""An epoch-aware, rewindable stream of prompt records (the controller's data source).

Each epoch visits every record once in an order fixed by (seed, epoch). The position is two integers, so it is
saved in checkpoints and restored exactly; `rewind` hands back prompts that were requested but not used.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class StreamPosition:
    epoch: int
    offset: int


class PromptStream:
    """Yields `(position, record)` over `total_epochs` passes of `records`; `None` when the last epoch is done."""

    def __init__(self, records: Sequence[Any], total_epochs: int, seed: int, shuffle: bool = True) -> None:
        if len(records) == 0:
            raise ValueError("the training dataset is empty; check data.train_files")
        self.records = records
        self.total_epochs = total_epochs
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.offset = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        generator = torch.Generator().manual_seed(self.seed * 100003 + epoch)
        return torch.randperm(len(self.records), generator=generator).tolist()

    @property
    def position(self) -> StreamPosition:
        return StreamPosition(self.epoch, self.offset)

    @property
    def exhausted(self) -> bool:
        return self.epoch >= self.total_epochs

    def next(self) -> tuple[StreamPosition, Any] | None:
        """The next record and its position, starting the next epoch when one ends; None after the last epoch."""
        if self.offset >= len(self._order):
            self.seek(StreamPosition(self.epoch + 1, 0))
        if self.exhausted:
            return None
        position = self.position
        record = self.records[self._order[self.offset]]
        self.offset += 1
        return position, record

    def seek(self, position: StreamPosition) -> None:
        """Move to a saved position (also used to rewind to the first prompt that was requested but not used)."""
        if position.epoch != self.epoch:
            self._order = self._epoch_order(position.epoch)
        self.epoch, self.offset = position.epoch, position.offset

    rewind = seek

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["seed"] != self.seed:
            raise ValueError(f"checkpoint data seed {state['seed']} differs from trainer.seed={self.seed}; "
                             "resume with the seed the run started with")
        self.seek(StreamPosition(state["epoch"], state["offset"]))
