"""Rank 0's count of the samples a run has generated, and what it makes due: `trainer.total_rollout_samples` ends the
run once the count reaches it, `trainer.test_freq_samples` validates after each step that crosses a multiple of it.

A budget of samples, rather than of steps, is what compares algorithms that generate differently per step on equal
terms: DAPO's filter-groups generates until enough prompts have a reward spread, so its step costs 1-4 generation
batches where GRPO's costs one. Every finished sample counts (`rollout/generated_samples` of the controller: kept,
dropped by a group filter, or finished after the batch filled), not only the trained ones. The count is a checkpointed
run control, so a resumed run goes on counting where it stopped.
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
