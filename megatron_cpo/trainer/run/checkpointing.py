"""Checkpoints of a run and `trainer.resume=auto`: everything needed to continue bit-for-bit on the same layout.

`<root>/step_<k>/rank_<r>.pt` holds each rank's model shard, the optimizer's local state (Adam moments, step, and
the fp32 main parameters of a reduced-precision model), the schedule and the RNG states, and with PPO's critic the
critic's shard, optimizer state and schedule beside the actor's (one file per rank, so resume restores both at the
same step or neither); rank 0's file also holds the data position and the state of rank 0's run controls (the
early-stop monitor), each under its name. A checkpoint is written into `step_<k>.tmp`, gets a manifest (sizes and
SHA-256 of the rank files; the actor's layout and LoRA settings), is renamed into place, and only then does
`<root>/latest` name it, so a run killed mid-save resumes from the previous one (checkpoint_files.py). On
resume a damaged checkpoint (or `latest`) is reported and the newest intact one is used. With `hf_model` in
`actor_rollout_ref.actor.checkpoint.save_contents` (the default) the actor is also written as a Hugging Face model
directory, `<root>/step_<k>/huggingface` (loadable with `from_pretrained`, or convertible to a Megatron checkpoint at
any TP/PP; a LoRA actor's is its PEFT adapter on the base model, docs/lora.md, and its rank files hold only the
adapters); with `hf_model` in `critic.checkpoint.save_contents` the critic too, as a token-classification model with
one label (`step_<k>/critic_huggingface`). Resuming needs the same world size and TP/PP layout; to change the
layout, start a new run from that Hugging Face directory (or the one tools/convert_mcore_to_hf.py writes from the
rank files later: checkpoint_conversion.py). No checkpoint holds a NaN or infinity: weights or optimizer
state that are not finite on some rank are never written (nor exported), and on resume a checkpoint that holds one
(written before this check existed) is passed over like a damaged one, naming it, for the newest good one.

Per-rank files are used instead of Megatron's distributed-checkpoint format because on CPU builds of Megatron-Core
0.16 (no Apex / Transformer Engine) its optimizer sharded state dict is not loadable.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron_cpo import platform
from megatron_cpo.models.lora.apply import load_trainable_state, lora_of, trainable_state
from megatron_cpo.trainer.run.checkpoint_files import (
    CRITIC_HF_DIR,
    HF_DIR,
    LATEST,
    TMP_SUFFIX,
    ActorRecord,
    CheckpointError,
    file_digest,
    rank_file_name,
    read_latest,
    step_dir_name,
    step_dirs,
    verify_checkpoint,
    write_latest,
    write_manifest,
)

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "CheckpointManager", "HF_DIR", "LATEST"]


def _inner_optimizers(optimizer: Any) -> list[Any]:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _main_params(inner: Any) -> list[torch.Tensor]:
    """The fp32 master copies a reduced-precision model keeps beside its parameters (empty for fp32 models)."""
    groups = getattr(inner, "shard_fp32_from_float16_groups", None) or getattr(inner, "fp32_from_float16_groups", [])
    return [p for group in groups for p in group if p is not None]


def first_non_finite(tree: Any, path: str) -> str | None:
    """The path of the first floating-point tensor in `tree` (nested dicts, lists and tuples) that holds a NaN or an
    infinity, e.g. "model/decoder.final_layernorm.weight"; None when all are finite. Min and max propagate both, so
    no tensor-sized mask is allocated."""
    if isinstance(tree, torch.Tensor):
        if tree.is_floating_point() and tree.numel():
            low, high = torch.aminmax(tree.detach())
            if not bool(torch.isfinite(low) & torch.isfinite(high)):
                return path
        return None
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, (list, tuple)) else ()
    return next((found for key, value in items if (found := first_non_finite(value, f"{path}/{key}"))), None)


def first_non_finite_model_state(state: dict) -> str | None:
    """Where a checkpoint state's weights or optimizer state (the actor's, and a critic's) first hold a NaN or an
    infinity, e.g. "critic/model/output_layer.weight"; None when all are finite."""
    found = first_non_finite({"actor": {key: state.get(key) for key in ("model", "optimizer")},
                              "critic": {key: (state.get("critic") or {}).get(key) for key in ("model", "optimizer")}},
                             "")
    return found.lstrip("/") if found else None


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


def model_state(model: Any) -> dict:
    """A trainable model's (the actor's, the critic's) shard, optimizer state and schedule on this rank; with LoRA
    only what trains (the adapters, a critic's value head): the frozen base comes from the model's path again."""
    weights = trainable_state(model.model) if lora_of(model.model) else model.model.state_dict()
    return {"model": weights, "optimizer": optimizer_state(model.optimizer),
            "scheduler": model.scheduler.state_dict()}


def actor_record(model: Any) -> ActorRecord:
    """The manifest's record of the actor `model` (a `MegatronPolicy`): this rank's parallel layout and its LoRA
    settings."""
    from megatron.core import parallel_state as ps

    lora = lora_of(model.model)
    return ActorRecord({"tensor_model_parallel_size": ps.get_tensor_model_parallel_world_size(),
                        "pipeline_model_parallel_size": ps.get_pipeline_model_parallel_world_size(),
                        "context_parallel_size": ps.get_context_parallel_world_size(),
                        "expert_model_parallel_size": ps.get_expert_model_parallel_world_size(),
                        "expert_tensor_parallel_size": ps.get_expert_tensor_parallel_world_size()},
                       None if lora is None else dataclasses.asdict(lora))


def load_model_state(model: Any, state: dict, where: str = "the checkpoint") -> None:
    if lora_of(model.model):
        load_trainable_state(model.model, state["model"], where)
    else:
        model.model.load_state_dict(state["model"])
    load_optimizer_state(model.optimizer, state["optimizer"])
    model.scheduler.load_state_dict(state["scheduler"])


class CheckpointManager:
    """Saves and restores the actor, its optimizer and schedule, a `critic`'s (PPO) the same way, RNG states, rank 0's
    data position (`stream`: the controller, whose state is the first prompt not yet trained) and `controls`: named
    objects with `state_dict()` / `load_state_dict()` (rank 0's, e.g. {"early_stop": monitor}). `export_hf` /
    `export_critic` write the actor / the critic as Hugging Face models into a checkpoint's directory. `keep`
    (`trainer.max_actor_ckpt_to_keep`): once a checkpoint is in place, all but the newest `keep` are deleted (None:
    none is)."""

    def __init__(self, root: Path, actor: Any, stream: Any, controls: dict[str, Any] | None = None,
                 export_hf: Callable[[Path], Any] | None = None, keep: int | None = None, critic: Any = None,
                 export_critic: Callable[[Path], Any] | None = None) -> None:
        self.root = root
        self.keep = keep
        self.actor = actor
        self.critic = critic
        self.stream = stream
        self.controls = controls or {}
        self.exports = {HF_DIR: export_hf, CRITIC_HF_DIR: export_critic}
        self.saved_step: int | None = None  # the step of the newest checkpoint written or loaded by this run

    @property
    def saved_path(self) -> Path | None:
        """The directory of `saved_step`: this run's newest checkpoint, written or resumed from (both checked to
        hold finite values)."""
        return None if self.saved_step is None else self.root / step_dir_name(self.saved_step)

    def _rank_name(self) -> str:
        return rank_file_name(dist.get_rank())

    def save(self, step: int) -> Path:
        """Collective: write step `step`'s checkpoint on every rank into a temporary directory, add the manifest,
        rename it into place, then point `latest` at it (so a kill at any moment leaves the previous one intact)."""
        final = self.root / step_dir_name(step)
        staging = self.root / (step_dir_name(step) + TMP_SUFFIX)
        state = {"step": step, "world_size": dist.get_world_size(), **model_state(self.actor), "rng": rng_state(),
                 "stream": self.stream.state_dict() if self.stream is not None else None,
                 "controls": {name: control.state_dict() for name, control in self.controls.items()}}
        if self.critic is not None:
            state["critic"] = model_state(self.critic)
        self._refuse_non_finite(state, step)
        if dist.get_rank() == 0:
            shutil.rmtree(staging, ignore_errors=True)  # left by a run killed while saving this step
            staging.mkdir(parents=True)
        dist.barrier()
        path = staging / self._rank_name()
        torch.save(state, path)
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, (path.name, file_digest(path)))
        for directory, export in self.exports.items():
            if export is not None:
                export(staging / directory)
        dist.barrier()
        if dist.get_rank() == 0:
            write_manifest(staging, step, dist.get_world_size(), dict(entries), actor_record(self.actor))
            if final.exists():  # written by an earlier attempt at this step that `latest` never named
                shutil.rmtree(final)
            os.replace(staging, final)
            write_latest(self.root, step)
            exported = [str(final / directory) for directory, export in self.exports.items() if export is not None]
            logger.info("saved checkpoint %s%s", final,
                        f" (with Hugging Face models in {', '.join(exported)})" if exported else "")
            if self.keep is not None:  # only once `latest` names the new one
                for old in sorted(step_dirs(self.root))[:-self.keep]:
                    if old != step:
                        shutil.rmtree(self.root / step_dir_name(old))
        dist.barrier()
        self.saved_step = step
        return final

    def _refuse_non_finite(self, state: dict, step: int) -> None:
        """Collective: raise `CheckpointError` on every rank when some rank's weights or optimizer state hold a NaN
        or an infinity (nothing is written then), naming it and the last good checkpoint."""
        entries = [None] * dist.get_world_size()
        dist.all_gather_object(entries, first_non_finite_model_state(state))
        bad = next(((rank, entry) for rank, entry in enumerate(entries) if entry is not None), None)
        if bad is None:
            return
        last = self.saved_path
        good = f"the last good checkpoint is {last}" if last is not None else "this run has no earlier checkpoint"
        raise CheckpointError(f"not checkpointing step {step}: {bad[1]} on rank {bad[0]} is not finite (NaN or "
                              f"infinite), so neither these weights nor a Hugging Face export of them are written; "
                              f"{good} (trainer.resume=auto resumes from the newest good checkpoint)")

    def maybe_resume(self, mode: str) -> int:
        """With `mode="auto"` and a checkpoint present, restore it and return its step; otherwise return 0.

        The checkpoint `latest` names is verified against its manifest first; when it (or `latest` itself) is
        damaged, the newest intact one is used instead, with a warning that names what was wrong. With none intact
        the run stops with a `CheckpointError` naming the damaged file."""
        if mode != "auto" or not self.root.is_dir():
            return 0
        problems: list[str] = []
        for step in self._candidates(problems):
            state = self._load_verified(step, problems)
            if state is None:
                continue
            if problems:
                logger.warning("resuming from the intact checkpoint %s (the newest with finite values) instead: %s",
                               self.root / step_dir_name(step), "; ".join(problems))
            self._restore(state, step)
            self.saved_step = step
            return step
        if problems:
            raise CheckpointError(f"no intact checkpoint with finite values in {self.root}: {'; '.join(problems)}. "
                                  "Delete the damaged files or set trainer.resume=disable with a new "
                                  "trainer.default_local_dir")
        return 0

    def _candidates(self, problems: list[str]) -> list[int]:
        """Steps to try, newest first: the one `latest` names, then every other complete step directory."""
        steps = sorted(step_dirs(self.root), reverse=True)
        try:
            named = read_latest(self.root)
        except CheckpointError as err:
            problems.append(str(err))
            return steps
        if named is None:
            if steps:
                problems.append(f"{self.root / LATEST} is missing")
            return steps
        if named not in steps:
            problems.append(f"{self.root / LATEST} names {step_dir_name(named)}, which does not exist")
            return steps
        return [named] + [s for s in steps if s < named]

    def _load_verified(self, step: int, problems: list[str]) -> dict | None:
        """Collective: this rank's state of checkpoint `step` when every rank's file is intact and finite, else None
        (and the reason appended to `problems`)."""
        directory = self.root / step_dir_name(step)
        state, problem = None, verify_checkpoint(directory, dist.get_world_size(), self._rank_name())
        if problem is None:
            try:
                state = torch.load(directory / self._rank_name(), weights_only=False)
            except Exception as err:  # a file that matches its manifest but does not load is damaged all the same
                problem = f"{directory / self._rank_name()} does not load ({type(err).__name__}: {err})"
            entry = None if state is None else first_non_finite_model_state(state)
            if entry is not None:  # written before checkpoints were checked: poisoned weights or optimizer state
                problem, state = f"{directory / self._rank_name()} holds a NaN or infinity in {entry}", None
        reports = [None] * dist.get_world_size()
        dist.all_gather_object(reports, problem)
        found = [report for report in reports if report is not None]
        if found:
            problems.extend(dict.fromkeys(found))
            return None
        return state

    def _restore(self, state: dict, step: int) -> None:
        directory = self.root / step_dir_name(step)
        if state["world_size"] != dist.get_world_size():  # a checkpoint written before manifests existed
            raise CheckpointError(f"checkpoint {directory} was written by {state['world_size']} ranks, this run has "
                                  f"{dist.get_world_size()}; resume with the same layout or set "
                                  "trainer.resume=disable with a new trainer.default_local_dir")
        saved_critic = state.get("critic")
        if (self.critic is None) != (saved_critic is None):  # both models come from one step, or the run stops
            has = "holds no critic" if saved_critic is None else "holds a critic"
            raise CheckpointError(f"checkpoint {directory} {has} and this run {'has' if self.critic else 'has none'} "
                                  "(algorithm.adv_estimator=gae trains one): resume with the algorithm it was written "
                                  "with, or set trainer.resume=disable with a new trainer.default_local_dir")
        load_model_state(self.actor, state, f"checkpoint {directory}")
        if self.critic is not None:
            load_model_state(self.critic, saved_critic, f"checkpoint {directory} (critic)")
        set_rng_state(state["rng"])
        if self.stream is not None:
            self.stream.load_state_dict(state["stream"])
        saved_controls = state.get("controls", {})
        for name, control in self.controls.items():
            if name in saved_controls:
                control.load_state_dict(saved_controls[name])
            else:
                logger.warning("checkpoint %s has no %s state (it was off when it was written); starting it fresh",
                               directory, name)
        logger.info("resumed from %s (step %d)", directory, step)


def hf_exporter(actor: Any, model_path: str, dtype: str) -> Callable[[Path], Any]:
    """Collective: writes the actor (or the critic) as a Hugging Face model directory in `dtype`
    (`megatron.params_dtype`), its config and tokenizer from `model_path` (the model it started from). A LoRA actor
    is written as its PEFT adapter on `model_path` instead; a LoRA critic merged (its value head is no adapter)."""
    if lora_of(actor.model) and not actor.model.value_head:
        from megatron_cpo.models.lora.peft_format import save_peft_adapter

        return lambda out: save_peft_adapter(actor.model, out, model_path, dtype=getattr(torch, dtype))
    from megatron_cpo.models.conversion_commands import export_hf_model

    return lambda out: export_hf_model(actor.model, actor.model.hf_config, model_path, out,
                                       dtype=getattr(torch, dtype))
