"""The sync check: do the engines serve the weights the trainer just pushed? (`actor_rollout_ref.rollout.sync_check`)

After a weight push every live engine continues a few fixed probe prompts greedily and returns its log-probs of
the tokens it chose (`RolloutEngines.sync_probe`: outside the request book, so the controller's `finished()` never
returns these requests and its `cancel_all()` never aborts them); the trainer scores the same tokens with the
actor it just pushed (`trainer/workers/sync_probe.py`). The largest |engine - trainer| log-prob difference is
`rollout/sync_check_max_abs_diff`; above `tolerance` the run stops naming the push. A reload that leaves part of
the engine's model behind (a layer vLLM did not re-process, a prefix cache serving keys of the old weights, a
tensor the sender never sent) shows up as a difference far above the numerical noise of the dtype in use.

This module holds the settings, the per-dtype tolerances and the comparison (pure tensor math); the engines' side
is `VLLMEngine.sync_probe`, the managers' `sync_probe`, and the reload report of `worker_extension.py`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from megatron_cpo.config_checks import check

# Default tolerance per dtype of the weights (trainer and engine use the same: actor.megatron.params_dtype with `auto`
# resolved), in log-prob units (nats) on the probe's greedy tokens; measurements in docs/launch.md, "Is the engine in
# sync?".
# float32: engines in sync differ by <= 1e-6 (tiny models) and <= 3.1e-5 (SmolLM2-135M); an engine that kept its
# tied head showed 0.33 after the first push at lr 3e-2 (tiny) and 2.6e-4 after the first push at lr 1e-6
# (SmolLM2). 16-bit: engines in sync differ by up to 0.03 (tiny) and 0.11 (SmolLM2-135M), since the two sides'
# kernels round differently; only a stale engine whose weights moved far stands out (float16: not measured here,
# the bfloat16 value, which has fewer mantissa bits, is kept).
DEFAULT_TOLERANCES = {"float32": 1e-4, "bfloat16": 0.5, "float16": 0.5}

DEFAULT_PROMPTS = ("Compute 17 + 25.", "Write one sentence about a lighthouse.")


@dataclass
class SyncCheckConfig:
    """`actor_rollout_ref.rollout.sync_check`: compare the engines with the trainer on a fixed probe after pushes.

    `enable`: run the check (and fail a push whose engines report a trainer tensor missing or sent twice).
    `every_n_pushes`: check the push before training and then every n-th push (1: every push; the probe costs a
    few greedy tokens per engine and one small forward of the actor: ~0.1 s on the tiny models, ~1-2 s on
    SmolLM2-135M on CPU, see docs/launch.md).
    `prompts`: the probe's prompts (chat template applied when the tokenizer has one); `max_tokens`: greedy tokens
    per prompt (the end-of-sequence token does not stop them).
    `tolerance`: the largest |engine - trainer| log-prob difference accepted; 0 takes the default of the weights'
    dtype (`DEFAULT_TOLERANCES`).
    """
    enable: bool = True
    every_n_pushes: int = 1
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    max_tokens: int = 8
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.sync_check."
        check(self.every_n_pushes >= 1,
              f"{prefix}every_n_pushes={self.every_n_pushes} must be >= 1 (1: check every push)")
        check(self.max_tokens >= 1, f"{prefix}max_tokens={self.max_tokens} must be >= 1")
        check(not self.enable or any(text.strip() for text in self.prompts),
              f"{prefix}prompts is empty; give at least one prompt or set {prefix}enable=false")
        check(self.tolerance >= 0, f"{prefix}tolerance={self.tolerance} must be >= 0 (0: the default of the dtype)")

    def tolerance_for(self, dtype: str) -> float:
        """The configured tolerance, or the default for weights of `dtype` ("float32", "bfloat16", "float16")."""
        if self.tolerance > 0:
            return self.tolerance
        check(dtype in DEFAULT_TOLERANCES, f"no default sync-check tolerance for dtype {dtype!r}; set "
                                           "actor_rollout_ref.rollout.sync_check.tolerance")
        return DEFAULT_TOLERANCES[dtype]

    def due(self, push: int) -> bool:
        """Whether push number `push` (0: the push before training) is checked."""
        return self.enable and push % self.every_n_pushes == 0


@dataclass
class ProbeGap:
    """How far the engines' log-probs of their probe tokens are from the trainer's."""
    max_abs_diff: float
    mean_abs_diff: float
    worst: str  # where the largest difference is, e.g. "engine 1, prompt 2, token 5"

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
    diff = (engine - trainer_log_probs.double()).abs().nan_to_num(nan=float("inf"))
    diff = torch.where(mask, diff, torch.zeros_like(diff))
    if not bool(mask.any()):
        return ProbeGap(0.0, 0.0, "no probe tokens")
    flat = int(diff.argmax())
    row, token = divmod(flat, width)
    return ProbeGap(float(diff.max()), float(diff.sum() / mask.sum()), f"{labels[row]}, token {token}")
