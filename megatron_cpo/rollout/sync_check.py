"""The sync check: do the engines serve the weights the trainer just pushed? (`actor_rollout_ref.rollout.sync_check`)

After a weight push every live engine continues a few fixed probe prompts greedily and returns its log-probs of
the tokens it chose (`RolloutEngines.sync_probe`: outside the request book, so the controller's `finished()` never
returns these requests and its `cancel_all()` never aborts them); the trainer scores the same tokens with the
actor it just pushed (`trainer/workers/sync_probe.py`). The largest |engine - trainer| log-prob difference is
`rollout/sync_check_max_abs_diff`; above `tolerance` the run stops naming the push. A reload that leaves part of
the engine's model behind (a layer vLLM did not re-process, a prefix cache serving keys of the old weights, a
tensor the sender never sent) shows up as a difference far above the numerical noise of the dtype in use.

This module holds the comparison (pure tensor math); the settings and the per-dtype tolerances are
`SyncCheckConfig` (config.py); the engines' side is `VLLMEngine.sync_probe`, the managers' `sync_probe`, and the
reload report of `worker_extension.py`.
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
