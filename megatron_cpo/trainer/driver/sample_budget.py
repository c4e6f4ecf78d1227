"""Rank 0's count of the samples a run has generated, and what it makes due: `trainer.total_rollout_samples` ends the
run, `trainer.test_freq_samples` validates. Every finished sample counts; the count is checkpointed. Why samples,
not steps: docs/trainer.md.
"""
from __future__ import annotations


class SampleBudget:
    """The samples generated so far (`generated`) against `trainer.total_rollout_samples` (`total`, 0: no budget)
    and `trainer.test_freq_samples` (`test_freq`, 0: validation by steps only)."""

    def __init__(self, total: int, test_freq: int) -> None:
        self.total, self.test_freq = total, test_freq
        self.generated = 0

    @property
    def spent(self) -> bool:
        """Whether the run has generated its budget of samples."""
        return self.total > 0 and self.generated >= self.total

    def add(self, samples: int) -> bool:
        """Count one step's generated samples; True when the step crossed a multiple of `test_freq`."""
        before, self.generated = self.generated, self.generated + samples
        return self.test_freq > 0 and self.generated // self.test_freq > before // self.test_freq

    def state_dict(self) -> dict[str, int]:
        return {"generated": self.generated}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.generated = int(state["generated"])
