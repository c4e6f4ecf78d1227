"""Rank 0's watch over the step's own engine-vs-trainer mismatch (`mismatch/*`, on the tokens the engines sampled):
a jump from one step to the next means the weight push in between went wrong, which it says once. The push itself is
checked on every rank by the sync probe (`trainer/workers/sync_probe.py`)."""
from __future__ import annotations

import logging

from megatron_cpo.rollout.config import SyncCheckConfig

logger = logging.getLogger(__name__)

JUMP_FACTOR = 10.0  # mismatch/log_probs_diff_mean growing this much from one step to the next is a jump


class MismatchWatch:
    """`settings`: `rollout.sync_check`, whose tolerance for `dtype` (the actor's compute dtype) is the noise a jump
    must exceed."""

    def __init__(self, settings: SyncCheckConfig, dtype: str) -> None:
        self.dtype = dtype
        self.tolerance = settings.tolerance_for(dtype)
        self._previous: tuple[int, float] | None = None
        self._warned = False

    def observe(self, step: int, metrics: dict[str, float]) -> None:
        """Once per step: warn (once per run) when the engine-vs-trainer mismatch of the sampled tokens jumped since
        the previous step beyond what the dtype's noise explains. With asynchronous training only the tokens sampled
        by the trained weights count (`mismatch/staleness_0/*`): older ones differ by the policy's change since, not
        by a push gone wrong; a step without such tokens is not observed."""
        split = any(key.startswith("mismatch/staleness_") for key in metrics)
        prefix = "mismatch/staleness_0/" if split else "mismatch/"
        mean, peak = metrics.get(prefix + "log_probs_diff_mean"), metrics.get(prefix + "log_probs_diff_max")
        if mean is None or peak is None:
            return
        previous, self._previous = self._previous, (step, mean)
        if self._warned or previous is None:
            return
        previous_step, previous_mean = previous
        if mean > JUMP_FACTOR * previous_mean and peak > self.tolerance:
            self._warned = True
            logger.warning(
                "mismatch/log_probs_diff_mean jumped from %.3g at step %d to %.3g at step %d (max %.3g, above the "
                "%s sync-check tolerance %g): step %d sampled right after the weight push of step %d, so the "
                "engines most likely do not serve the pushed weights (a layer their reload did not update, e.g. a "
                "tied output head or MoE experts, or a push that missed an engine); see "
                "rollout/sync_check_max_abs_diff and docs/launch.md, \"Is the engine in sync?\"", previous_mean,
                previous_step, mean, step, peak, self.dtype, self.tolerance, step, previous_step)
