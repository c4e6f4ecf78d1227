"""The sync check: do the engines serve the weights the trainer just pushed? (`actor_rollout_ref.rollout.sync_check`)

Engines continue fixed probe prompts greedily and the trainer scores the same tokens; the largest log-prob
difference (`rollout/sync_check_max_abs_diff`) above `tolerance` stops the run. This module holds the comparison;
the settings are `SyncCheckConfig` (config.py). docs/launch.md, "Is the engine in sync?".
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ProbeGap:
    """How far the engines' log-probs of their probe tokens are from the trainer's. `trainer_non_finite`: where the
    trainer's own log-prob is NaN or infinite and what it is (its weights are not finite: the engines were sent
    them, so the difference says nothing about the sync), None when all are finite."""
    max_abs_diff: float
    mean_abs_diff: float
    worst: str  # where the largest difference is, e.g. "engine 1, prompt 2, token 5"
    trainer_non_finite: str | None = None

    def metrics(self) -> dict[str, float]:
        return {"rollout/sync_check_max_abs_diff": self.max_abs_diff,
                "rollout/sync_check_mean_abs_diff": self.mean_abs_diff}


def compare_probe(labels: list[str], engine_log_probs: list[list[float]], trainer_log_probs: torch.Tensor
                  ) -> ProbeGap:
    """`engine_log_probs[i]`: an engine's log-probs of its probe sequence i (labelled `labels[i]`, e.g.
    "engine 0, prompt 1"); `trainer_log_probs`: [rows, width] float, the trainer's of the same tokens (row i's first
    len(engine_log_probs[i]) entries)."""
    lengths = torch.tensor([len(row) for row in engine_log_probs])
    width = trainer_log_probs.shape[1]
    engine = torch.zeros(len(engine_log_probs), width, dtype=torch.float64)
    for index, row in enumerate(engine_log_probs):
        engine[index, :len(row)] = torch.tensor(row, dtype=torch.float64)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    trainer = trainer_log_probs.double()
    diff = (engine - trainer).abs().nan_to_num(nan=float("inf"))
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    if not bool(mask.any()):
        return ProbeGap(0.0, 0.0, "no probe tokens")
    row, token = divmod(int(diff.argmax()), width)
    gap = ProbeGap(float(diff.max()), float(diff.sum() / mask.sum()), f"{labels[row]}, token {token}")
    trainer_bad = mask & ~torch.isfinite(trainer)
    if bool(trainer_bad.any()):
        row, token = divmod(int(trainer_bad.flatten().nonzero()[0]), width)
        gap.trainer_non_finite = f"{float(trainer[row, token])} at {labels[row]}, token {token}"
    return gap
