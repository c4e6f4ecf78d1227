"""RAGEN's reward-variance early stop (`trainer.early_stop.*`): end the run once the rewards of a prompt's responses
no longer differ, since GRPO then has nothing left to compare.

The run's rank 0 feeds the monitor one value per step, `rollout/in_group_reward_std` (the mean in-group reward std of
every group judged for the step, filtered ones included, see trainer/driver/accumulator.py); the monitor's state is
checkpointed with the run, so a resumed run continues (or stays stopped) where it was.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class EarlyStopConfig:
    """`trainer.early_stop.*`: stop when the in-group reward std has collapsed (RAGEN's reward-variance early stop).
    Every step is one attempt whose value is `rollout/in_group_reward_std` over all the groups generated for it
    (filtered ones included); the baseline is the mean over the first `baseline_steps` steps; the run stops, logging
    `train/early_stopped: 1` and the reason, once the last `window` attempts are all below `ratio * baseline`. The
    monitor's state is checkpointed, so a resumed run continues (or stays stopped) where it was."""

    enable: bool = False
    baseline_steps: int = 10
    window: int = 10
    ratio: float = 0.1

    def __post_init__(self) -> None:
        if self.baseline_steps < 1:
            raise ValueError(f"trainer.early_stop.baseline_steps={self.baseline_steps} must be >= 1")
        if self.window < 1:
            raise ValueError(f"trainer.early_stop.window={self.window} must be >= 1 (attempts that must all be low)")
        if not self.ratio > 0:
            raise ValueError(f"trainer.early_stop.ratio={self.ratio} must be > 0 (e.g. 0.1: stop below 10% of the "
                             "baseline std)")


class EarlyStopMonitor:
    """Stop training when the in-group reward std has collapsed: all of the last `window` attempts are below
    `ratio` x the baseline (the mean over the first `baseline_steps` successful steps)."""

    def __init__(self, config: EarlyStopConfig | None = None) -> None:
        self.config = config or EarlyStopConfig()
        self._baseline_values: list[float] = []
        self._recent: deque = deque(maxlen=self.config.window)
        self.stopped = False

    @property
    def baseline(self) -> float | None:
        """The baseline std once `baseline_steps` successful steps were seen, else None."""
        if len(self._baseline_values) < self.config.baseline_steps:
            return None
        return sum(self._baseline_values) / len(self._baseline_values)

    def observe(self, reward_std: float, successful: bool) -> bool:
        """Record one rollout attempt (`successful`: it went on to a training step); returns whether to stop."""
        if successful and len(self._baseline_values) < self.config.baseline_steps:
            self._baseline_values.append(float(reward_std))
        self._recent.append(float(reward_std))
        baseline = self.baseline
        if baseline is not None and len(self._recent) == self.config.window:
            self.stopped = self.stopped or all(v < self.config.ratio * baseline for v in self._recent)
        return self.stopped

    def state_dict(self) -> dict:
        """Plain-Python state for checkpoints."""
        return {"baseline_values": list(self._baseline_values), "recent": list(self._recent), "stopped": self.stopped}

    def load_state_dict(self, state: dict) -> None:
        """Restore from `state_dict()`; the window keeps the newest `config.window` values."""
        self._baseline_values = [float(v) for v in state["baseline_values"]]
        self._recent = deque((float(v) for v in state["recent"]), maxlen=self.config.window)
        self.stopped = bool(state["stopped"])
