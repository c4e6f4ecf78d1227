"""Methods added to every vLLM worker (via `worker_extension_cls`) so that new weights load in place.

A sync is three calls, made through `collective_rpc` on every worker of an engine:
`rollout_begin_weight_reload` -> `rollout_load_weight_bucket` (once per bucket, from any sending rank) ->
`rollout_finish_weight_reload`. They are the steps of vLLM's own `model_runner.reload_weights`, split so that
buckets can arrive one at a time from several pipeline stages: a layer is re-processed (e.g. CPU weight prepacking)
as soon as all of its tensors have arrived, and layers that received nothing keep their weights.
Method names start with `rollout_` so they never clash with the worker's own methods.
"""
from __future__ import annotations

from megatron_cpo.rollout.buckets import BucketSpec, read_bucket


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner` and `vllm_config`)."""

    def rollout_begin_weight_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())

    def rollout_load_weight_bucket(self, wire_spec: list) -> int:
        """Load one bucket's HF-named full tensors (vLLM shards them for its own TP); returns the tensor count."""
        from vllm.config import set_current_vllm_config

        spec = BucketSpec.from_wire(wire_spec)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(read_bucket(spec))
        return len(spec.entries)

    def rollout_finish_weight_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
