"""Park the actor's training state in host memory while colocated engines generate, and bring it back to train
(verl's `actor_rollout_ref.actor.megatron.{param,grad,optimizer}_offload`, with `rollout.mode=colocate`).

Moves tensor storages, not tensors, so every view into Megatron's contiguous buffers stays valid (docs/trainer.md).
"""
from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

PARTS = ("params", "grads", "optimizer")
SWITCHES = ("param_offload", "grad_offload", "optimizer_offload")
"""verl's `actor_rollout_ref.actor.megatron.*_offload` switch of each of `PARTS`."""
_cpu_notice_logged = False


def configured_parts(megatron: Any) -> tuple[str, ...]:
    """The parts (of `PARTS`) that the `actor.megatron` section's `*_offload` switches select."""
    return tuple(part for part, switch in zip(PARTS, SWITCHES) if getattr(megatron, switch))


def _inner_optimizers(optimizer: Any) -> list[Any]:
    """The torch optimizers under a Megatron optimizer (chained or not)."""
    if optimizer is None:
        return []
    chained = getattr(optimizer, "chained_optimizers", None)
    members = chained if chained is not None else [optimizer]
    return [member.optimizer for member in members if getattr(member, "optimizer", None) is not None]


def _ddp_buffers(ddp_model: Any) -> list[Any]:
    if ddp_model is None:
        return []
    return list(getattr(ddp_model, "buffers", [])) + list(getattr(ddp_model, "expert_parallel_buffers", []))


def actor_tensors(model: Any, ddp_model: Any = None, optimizer: Any = None) -> dict[str, list[torch.Tensor]]:
    """Every tensor of each part: parameters (and DDP's `param_data`), gradients (DDP's `grad_data`, `main_grad`,
    `.grad`, the optimizer's main-parameter grads) and the optimizer's main parameters and state."""
    buffers = _ddp_buffers(ddp_model)
    inner = _inner_optimizers(optimizer)
    params = list(model.parameters())
    main_params = [p for opt in inner for group in opt.param_groups for p in group["params"]]
    param_tensors = params + [b.param_data for b in buffers if getattr(b, "param_data", None) is not None]
    grad_tensors = [b.grad_data for b in buffers if getattr(b, "grad_data", None) is not None]
    grad_tensors += [g for p in params + main_params for g in (getattr(p, "main_grad", None), p.grad) if g is not None]
    state_tensors = [value for opt in inner for state in opt.state.values() for value in state.values()
                     if torch.is_tensor(value)]
    return {"params": param_tensors, "grads": grad_tensors, "optimizer": main_params + state_tensors}


def _whole(storage: torch.UntypedStorage, nbytes: int) -> torch.Tensor:
    """A byte tensor over all of `storage`."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (nbytes,), (1,))


class _Parked:
    """One device storage and its host copy."""

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage
        self.nbytes = storage.nbytes()
        self.host: torch.Tensor | None = None
        self.offloaded = False

    def copy_out(self, pin: bool) -> None:
        if self.host is None:
            self.host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host.copy_(_whole(self.storage, self.nbytes), non_blocking=pin)

    def free(self) -> None:
        self.storage.resize_(0)
        self.offloaded = True

    def copy_back(self, pin: bool) -> None:
        self.storage.resize_(self.nbytes)
        _whole(self.storage, self.nbytes).copy_(self.host, non_blocking=pin)
        self.offloaded = False


class ActorOffload:
    """Moves the parts of one actor (model, DDP wrapper, Megatron optimizer) to host memory and back.

    `offload(parts)` / `reload(parts)` move the named parts (default: the configured ones); both are idempotent.
    Each `offload` first looks for storages created since the last one (Adam makes its moments at the first step,
    after the first rollout), so the offload can be built with the actor.
    """

    def __init__(self, model: Any, ddp_model: Any = None, optimizer: Any = None, parts: tuple[str, ...] = PARTS,
                 device: torch.device | None = None) -> None:
        self.model, self.ddp_model, self.optimizer = model, ddp_model, optimizer
        self.parts = parts
        self.device = device if device is not None else next(model.parameters()).device
        self.pin = self.device.type == "cuda"
        self._parked: dict[str, dict[int, _Parked]] = {part: {} for part in PARTS}
        self.refresh()

    @classmethod
    def for_policy(cls, policy: Any, parts: tuple[str, ...]) -> ActorOffload:
        """The offload of a `MegatronPolicy` or `MegatronCritic` (its model, DDP wrapper and optimizer)."""
        return cls(policy.model, policy.ddp_model, policy.optimizer, parts)

    def refresh(self) -> None:
        """Look at the actor's storages again: pick up new ones (Adam's moments after the first step) and let go of
        the ones it no longer holds (optimizer state replaced by a checkpoint load), so no stale storage is kept
        alive. Offloaded ones are known (and empty), so this is safe at any time."""
        known = {key: parked for group in self._parked.values() for key, parked in group.items()}
        current: dict[str, dict[int, _Parked]] = {part: {} for part in PARTS}
        for part, tensors in actor_tensors(self.model, self.ddp_model, self.optimizer).items():
            for tensor in tensors:
                storage = tensor.untyped_storage()
                key = storage._cdata  # the storage itself, stable while its memory is freed and re-grown
                if any(key in group for group in current.values()):
                    continue  # shared with an earlier part
                if key in known:
                    current[part][key] = known.pop(key)
                elif storage.device == self.device and storage.nbytes() > 0:  # not host-resident (Adam's step)
                    current[part][key] = _Parked(storage)
        for part in PARTS:  # offloaded state always stays reachable, whatever the actor holds now
            current[part].update({key: p for key, p in self._parked[part].items() if key in known and p.offloaded})
        self._parked = current

    def nbytes(self, part: str) -> int:
        """Device bytes that part `part` occupies when loaded."""
        return sum(p.nbytes for p in self._parked[part].values())

    def storages(self, part: str) -> list[torch.UntypedStorage]:
        return [p.storage for p in self._parked[part].values()]

    def is_offloaded(self, part: str) -> bool:
        return any(p.offloaded for p in self._parked[part].values())

    def _selected(self, parts: Iterable[str] | None) -> list[_Parked]:
        names = self.parts if parts is None else tuple(parts)
        unknown = [name for name in names if name not in PARTS]
        if unknown:
            raise ValueError(f"unknown actor offload part(s) {unknown}; choose from {list(PARTS)}")
        return [p for name in names for p in self._parked[name].values()]

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def offload(self, parts: Iterable[str] | None = None) -> int:
        """Copy the parts to host memory and free their device memory; returns the bytes freed."""
        _log_cpu_notice_once(self.device)
        self.refresh()
        moving = [p for p in self._selected(parts) if not p.offloaded]
        for parked in moving:
            parked.copy_out(self.pin)
        self._synchronize()  # the host copies are complete before the device memory goes
        for parked in moving:
            parked.free()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # hand the freed blocks back to the driver, where the engines can take them
        return sum(p.nbytes for p in moving)

    def reload(self, parts: Iterable[str] | None = None) -> int:
        """Re-allocate the parts on the device and copy them back; returns the bytes restored."""
        moving = [p for p in self._selected(parts) if p.offloaded]
        for parked in moving:
            parked.copy_back(self.pin)
        self._synchronize()
        return sum(p.nbytes for p in moving)


@contextlib.contextmanager
def offloaded_during(*offloads: ActorOffload | None) -> Iterator[None]:
    """The rollout phase of a colocated step: the configured parts of each model (the actor's, a critic's) are on the
    host inside the block and back on the device after it (also when it raises); None (not colocated, or nothing
    configured) does nothing."""
    active = [offload for offload in offloads if offload is not None]
    for offload in active:
        offload.offload()
    try:
        yield
    finally:
        for offload in active:
            offload.reload()


def _log_cpu_notice_once(device: torch.device) -> None:
    global _cpu_notice_logged
    if device.type == "cpu" and not _cpu_notice_logged:
        _cpu_notice_logged = True
        logger.info("actor offload does nothing useful on this platform (no accelerator: host and device memory are "
                    "the same); the state is still copied to a separate host buffer and back")


def colocated_offload(policy: Any, megatron: Any, rollout_mode: str,
                      section: str = "actor_rollout_ref.actor.megatron") -> ActorOffload | None:
    """The offload of a trainable model of the run (the actor; a critic, whose switches are `critic.megatron.*`:
    `section`), or None: when none of its `*_offload` switches is on, or when the engines are not colocated
    (`rollout_mode` other than "colocate": they have devices of their own, so there is nothing to make room for, and
    one log line says the switches do nothing)."""
    parts = configured_parts(megatron)
    if not parts:
        return None
    if rollout_mode != "colocate":
        switches = ", ".join(f"{section}.{name}" for name in SWITCHES if getattr(megatron, name))
        logger.info("%s do(es) nothing with actor_rollout_ref.rollout.mode=%s: the engines have devices of their own; "
                    "models are offloaded only when colocated (mode=colocate)", switches, rollout_mode)
        return None
    return ActorOffload.for_policy(policy, parts)
