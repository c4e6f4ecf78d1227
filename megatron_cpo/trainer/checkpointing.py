"""Checkpoints of a run and `trainer.resume=auto`: everything needed to continue bit-for-bit on the same layout.

`<root>/step_<k>/rank_<r>.pt` holds each rank's model shard, the optimizer's local state (Adam moments, step, and
the fp32 main parameters of a reduced-precision model), the schedule and the RNG states; rank 0's file also holds the
data position and the state of rank 0's run controls (the early-stop monitor), each under its name. `<root>/latest`
names the newest complete checkpoint and is written after a barrier, so a run killed mid-save resumes from the
previous one. With `hf_model` in `actor_rollout_ref.actor.checkpoint.save_contents` (the default) the actor is then
also written as a Hugging Face model directory, `<root>/step_<k>/huggingface` (loadable with `from_pretrained`, or
convertible to a Megatron checkpoint at any TP/PP). Resuming needs the same world size and TP/PP layout; to change the
layout, start a new run from that Hugging Face directory.

Per-rank files are used instead of Megatron's distributed-checkpoint format because on CPU builds of Megatron-Core
0.16 (no Apex / Transformer Engine) its optimizer sharded state dict is not loadable.
"""
from __future__ import annotations

import logging
import os
import random
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from megatron_cpo import platform

logger = logging.getLogger(__name__)

LATEST = "latest"
HF_DIR = "huggingface"


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(inner: Any) -> list[torch.Tensor]:
    """The fp32 master copies a reduced-precision model keeps beside its parameters (empty for fp32 models)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group if p is not None]


def optimizer_state(optimizer: Any) -> list[dict]:
    return [{"torch": inner.optimizer.state_dict(), "main_params": [p.detach().clone() for p in _main_params(inner)]}
            for inner in _inner_optimizers(optimizer)]


@torch.no_grad()
def load_optimizer_state(optimizer: Any, state: list[dict]) -> None:
    inners = _inner_optimizers(optimizer)
    if len(inners) != len(state):
        raise ValueError(f"checkpoint has {len(state)} optimizer parts but this run has {len(inners)}; resume with the "
                         "configuration (optimizer, dtype, TP/PP) the checkpoint was written with")
    for inner, saved in zip(inners, state):
        inner.optimizer.load_state_dict(saved["torch"])
        for param, value in zip(_main_params(inner), saved["main_params"]):
            param.copy_(value)


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if platform.has_cuda() else None,
            "megatron": _megatron_rng_tracker().get_states()}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if state["cuda"] is not None and platform.has_cuda():
        torch.cuda.set_rng_state_all(state["cuda"])
    _megatron_rng_tracker().set_states(state["megatron"])


def _megatron_rng_tracker() -> Any:
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    return get_cuda_rng_tracker()


class CheckpointManager:
    """Saves and restores the actor, its optimizer and schedule, RNG states, rank 0's data stream and `controls`:
    named objects with `state_dict()` / `load_state_dict()` (rank 0's, e.g. {"early_stop": monitor})."""

    def __init__(self, root: Path, actor: Any, stream: Any, controls: dict[str, Any] | None = None,
                 export_hf: Callable[[Path], Any] | None = None) -> None:
        self.root = root
        self.actor = actor
        self.stream = stream
        self.controls = controls or {}
        self.export_hf = export_hf

    def _rank_file(self, step: int) -> Path:
        return self.root / f"step_{step:06d}" / f"rank_{dist.get_rank():05d}.pt"

    def save(self, step: int) -> Path:
        """Collective: write step `step`'s checkpoint on every rank, then point `latest` at it."""
        path = self._rank_file(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        state = {"step": step, "world_size": dist.get_world_size(), "model": self.actor.model.state_dict(),
                 "optimizer": optimizer_state(self.actor.optimizer),
                 "scheduler": self.actor.scheduler.state_dict(), "rng": rng_state(),
                 "stream": self.stream.state_dict() if self.stream is not None else None,
                 "controls": {name: control.state_dict() for name, control in self.controls.items()}}
        tmp = path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)
        dist.barrier()
        if dist.get_rank() == 0:
            (self.root / (LATEST + ".tmp")).write_text(path.parent.name + "\n")
            os.replace(self.root / (LATEST + ".tmp"), self.root / LATEST)
            logger.info("saved checkpoint %s", path.parent)
        dist.barrier()
        if self.export_hf is not None:
            self.export_hf(path.parent / HF_DIR)
            if dist.get_rank() == 0:
                logger.info("saved the actor as a Hugging Face model in %s", path.parent / HF_DIR)
        return path.parent

    def latest_step(self) -> int | None:
        marker = self.root / LATEST
        if not marker.is_file():
            return None
        return int(marker.read_text().strip().removeprefix("step_"))

    def maybe_resume(self, mode: str) -> int:
        """With `mode="auto"` and a checkpoint present, restore it and return its step; otherwise return 0."""
        step = self.latest_step() if mode == "auto" else None
        if step is None:
            return 0
        path = self._rank_file(step)
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: the checkpoint in {self.root} was written by a run with a "
                                    f"different world size; resume with that layout or set trainer.resume=disable")
        state = torch.load(path, weights_only=False)
        if state["world_size"] != dist.get_world_size():
            raise ValueError(f"checkpoint {path.parent} was written by {state['world_size']} ranks, this run has "
                             f"{dist.get_world_size()}; resume with the same layout or set trainer.resume=disable")
        self.actor.model.load_state_dict(state["model"])
        load_optimizer_state(self.actor.optimizer, state["optimizer"])
        self.actor.scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        saved_controls = state.get("controls", {})
        for name, control in self.controls.items():
            if name in saved_controls:
                control.load_state_dict(saved_controls[name])
            else:
                logger.warning("checkpoint %s has no %s state (it was off when it was written); starting it fresh",
                               path.parent, name)
        logger.info("resumed from %s (step %d)", path.parent, step)
        return step
