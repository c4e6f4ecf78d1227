"""Rollout: Ray-spawned vLLM engines that generate groups of samples and take new weights in place."""
from megatron_cpo.rollout.manager import RolloutManager
from megatron_cpo.rollout.types import (RolloutConfig, RolloutEngineStartError, RolloutEnginesLostError, RolloutGroup,
                                        RolloutSample, SamplingParams, derive_sample_seeds)
from megatron_cpo.rollout.weight_sync import WeightSender, WeightSenderSpec

__all__ = ["RolloutConfig", "RolloutEngineStartError", "RolloutEnginesLostError", "RolloutGroup", "RolloutManager",
           "RolloutSample", "SamplingParams", "WeightSender", "WeightSenderSpec", "derive_sample_seeds"]
