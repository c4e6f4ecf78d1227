"""Methods added to every vLLM worker (via `worker_extension_cls`) so that new weights load in place.

vLLM's `reload_weights` split into begin / load bucket / finish, so buckets can arrive one at a time from several
pipeline stages; the finish re-derives tied layers and reports which parameters were filled or repeated
(docs/rollout.md, "Loading weights in place").
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import torch

from megatron_cpo.rollout.buckets import BucketSpec, entries_from_wire, read_bucket, unpack_bucket
from megatron_cpo.rollout.collective import WeightGroup, connect_weight_store
from megatron_cpo.rollout.moe_reload import prepack_cpu_experts_on_reload


class ReloadLedger:
    """What one reload received: tensor names (counted) and the model parameters they filled."""

    def __init__(self, expected: Iterable[str]) -> None:
        self.expected = set(expected)
        self.received: Counter[str] = Counter()
        self.filled: set[str] = set()

    def record(self, tensor_names: Iterable[str], filled: set[str] | None) -> None:
        self.received.update(tensor_names)
        self.filled |= filled or set()

    def report(self) -> dict:
        """{"tensors": received count, "missing": parameters nothing filled, "repeated": names sent twice+}."""
        return {"tensors": sum(self.received.values()), "missing": sorted(self.expected - self.filled),
                "repeated": sorted(name for name, count in self.received.items() if count > 1)}


def tied_layers(model: torch.nn.Module) -> list[str]:
    """Names of the layers (with a `quant_method`) whose parameter is the same tensor as an earlier layer's."""
    owner: dict[int, str] = {}
    followers = []
    for name, module in model.named_modules():
        if getattr(module, "quant_method", None) is None:
            continue
        for param in module.parameters(recurse=False):
            first = owner.setdefault(id(param), name)
            if first != name and name not in followers:
                followers.append(name)
    return followers


class WeightReloadExtension:
    """Mixed into vLLM's worker class; `self` is the worker (it has `model_runner` and `vllm_config`)."""

    def rollout_begin_weight_reload(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        model = self.model_runner.get_model()
        prepack_cpu_experts_on_reload(model)  # vLLM 0.32 prepacks CPU experts at the first load only
        # before the reload moves layers to the meta device (and unties them there)
        self._rollout_tied = tied_layers(model)
        self._rollout_ledger = ReloadLedger(name for name, _ in model.named_parameters())
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(model)

    def _rollout_load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        from vllm.config import set_current_vllm_config

        with set_current_vllm_config(self.vllm_config):
            filled = self.model_runner.get_model().load_weights(named_tensors)
        ledger = self.__dict__.get("_rollout_ledger")
        if ledger is not None:
            ledger.record((name for name, _ in named_tensors), filled)
        return len(named_tensors)

    def rollout_load_weight_bucket(self, wire_spec: list) -> int:
        """Load one bucket's HF-named full tensors (vLLM shards them for its own TP); returns the tensor count."""
        return self._rollout_load(list(read_bucket(BucketSpec.from_wire(wire_spec))))

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
        groups = self.__dict__.get("_rollout_weight_groups", {})
        if name not in groups:
            raise RuntimeError(f"this engine worker is not in weight-sync group {name!r} (joined: {sorted(groups)}); "
                               "the sender must open the group (rollout_join_weight_group) before sending buckets")
        group = groups[name]
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=group.device)
        group.broadcast(buffer)
        return self._rollout_load(list(unpack_bucket(buffer, entries_from_wire(wire_entries))))

    def rollout_leave_weight_group(self, name: str | None = None) -> int:
        """Close weight-sync group `name` (every group when None); returns how many were closed."""
        groups = self.__dict__.get("_rollout_weight_groups", {})
        names = list(groups) if name is None else [name] if name in groups else []
        for group_name in names:
            groups.pop(group_name).close()
        return len(names)

    def rollout_finish_weight_reload(self) -> dict:
        """Close the reload, re-derive tied layers, drop caches; returns the reload's `ReloadLedger.report()`."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        model = self.model_runner.get_model()
        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(model, self.vllm_config.model_config)
            for name in self.__dict__.get("_rollout_tied", []):
                layer = model.get_submodule(name)
                layer.quant_method.process_weights_after_loading(layer)
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        ledger = self.__dict__.pop("_rollout_ledger", None)
        return ledger.report() if ledger is not None else {"tensors": 0, "missing": [], "repeated": []}
