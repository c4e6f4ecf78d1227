"""Methods added to every vLLM worker (via `worker_extension_cls`) so that new weights load in place.

A sync is three calls, made through `collective_rpc` on every worker of an engine:
`rollout_begin_weight_reload` -> `rollout_load_weight_bucket` (once per bucket, from any sending rank) ->
`rollout_finish_weight_reload`. They are the steps of vLLM's own `model_runner.reload_weights`, split so that
buckets can arrive one at a time from several pipeline stages: a layer is re-processed (e.g. CPU weight prepacking)
as soon as all of its tensors have arrived, and layers that received nothing keep their weights.
Buckets arrive by one of two transports: `rollout_load_weight_bucket` maps a shared-memory file;
`rollout_receive_weight_bucket` receives the bytes by broadcast over a weight-sync group the worker joined with
`rollout_join_weight_group` (see `collective.py`). Method names start with `rollout_` so they never clash with the
worker's own methods.
"""
from __future__ import annotations

import torch

from megatron_cpo.rollout.buckets import BucketSpec, entries_from_wire, read_bucket, unpack_bucket
from megatron_cpo.rollout.collective import WeightGroup, connect_weight_store
from megatron_cpo.rollout.moe_reload import prepack_cpu_experts_on_reload


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner` and `vllm_config`)."""

    def rollout_begin_weight_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        prepack_cpu_experts_on_reload(model)  # vLLM 0.32 prepacks CPU experts at the first load only
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def rollout_load_weight_bucket(self, wire_spec: list) -> int:
        """Load one bucket's HF-named full tensors (vLLM shards them for its own TP); returns the tensor count."""
        from vllm.config import set_current_vllm_config

        spec = BucketSpec.from_wire(wire_spec)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(read_bucket(spec))
        return len(spec.entries)

    def rollout_join_weight_group(self, name: str, host: str, port: int, first_rank: int, world_size: int,
                                  timeout_s: float) -> int:
        """Join the sending rank's weight-sync group as rank `first_rank + self.rank` (this worker's rank within its
        engine); a group of the same name joined before is closed first. Returns the rank taken."""
        groups = self.__dict__.setdefault("_rollout_weight_groups", {})
        self.rollout_leave_weight_group(name)
        rank = first_rank + self.rank
        store = connect_weight_store(host, port, timeout_s)
        groups[name] = WeightGroup(store, name, f"{host}:{port}", rank, world_size, timeout_s)
        return rank

    def rollout_receive_weight_bucket(self, name: str, wire_entries: list, nbytes: int) -> int:
        """Receive one bucket broadcast over group `name` and load it like `rollout_load_weight_bucket`."""
        from vllm.config import set_current_vllm_config

        groups = self.__dict__.get("_rollout_weight_groups", {})
        if name not in groups:
            raise RuntimeError(f"this engine worker is not in weight-sync group {name!r} (joined: {sorted(groups)}); "
                               "the sender must open the group (rollout_join_weight_group) before sending buckets")
        group = groups[name]
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        entries = entries_from_wire(wire_entries)
        with set_current_vllm_config(self.vllm_config):
            self.model_runner.get_model().load_weights(unpack_bucket(buffer, entries))
        return len(entries)

    def rollout_leave_weight_group(self, name: str | None = None) -> int:
        """Close weight-sync group `name` (every group when None); returns how many were closed."""
        groups = self.__dict__.get("_rollout_weight_groups", {})
        names = list(groups) if name is None else [name] if name in groups else []
        for group_name in names:
            groups.pop(group_name).close()
        return len(names)

    def rollout_finish_weight_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self.model_runner.get_model(), self.vllm_config.model_config)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
