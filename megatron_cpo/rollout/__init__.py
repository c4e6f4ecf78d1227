"""Rollout: vLLM engines that generate groups of samples and take new weights in place.

`rollout.mode` picks where engines run (`modes.build_rollout_manager`): Ray actors, `megatron-cpo rollout` HTTP
servers (server.py) or servers colocated on the trainer's devices (colocate.py), all behind one manager interface
(docs/rollout.md shows it). Names load on first use, so loading a config imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "manager": ("RolloutManager",),
    "config": ("RolloutEngineConfig",),
    "types": ("EngineLaunchConfig", "RolloutEngineStartError", "RolloutEnginesLostError", "RolloutGroup",
              "RolloutSample", "SamplingParams", "derive_sample_seeds"),
    "collective": ("WeightGroupJoinError",),
    "weight_sync": ("WeightSender", "WeightSenderSpec", "close_weight_groups", "send_from_pipeline_stages"),
})
