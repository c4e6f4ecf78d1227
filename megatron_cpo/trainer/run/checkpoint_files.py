"""The on-disk layout of a run's checkpoints, and how each one is verified before it is trusted.

`<root>/step_<k>/`: `rank_<r>.pt` per rank, `manifest.json` (step, world size, size and SHA-256 of each rank file,
the actor's parallel layout and LoRA settings), optionally `huggingface/` and `critic_huggingface/`. Written as
`step_<k>.tmp`, renamed when complete, then `<root>/latest` is replaced, so the newest directory without `.tmp` is
whole and its manifest finds a bad file.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from megatron_cpo.trainer.run.errors import RunAbortedError

LATEST = "latest"
HF_DIR = "huggingface"
CRITIC_HF_DIR = "critic_huggingface"
MANIFEST = "manifest.json"
TMP_SUFFIX = ".tmp"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RunAbortedError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def step_dirs(root: Path) -> list[int]:
    """Steps of the complete (renamed into place) step directories under `root`."""
    if not root.is_dir():
        return []
    return [int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root)) if m and (root / m.group(0)).is_dir()]


def read_latest(root: Path) -> int | None:
    """The step `<root>/latest` names; None when there is no marker; `CheckpointError` when it is unreadable."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    text = marker.read_text(errors="replace").strip()
    match = _STEP_DIR.match(text)
    if match is None:
        raise CheckpointError(f"{marker} holds {text[:40]!r}, not a step directory name like 'step_000004'")
    return int(match.group(1))


def write_latest(root: Path, step: int) -> None:
    """Point `latest` at step `step` atomically (write a temporary file, then rename it over the marker)."""
    tmp = root / (LATEST + TMP_SUFFIX)
    tmp.write_text(step_dir_name(step) + "\n")
    os.replace(tmp, root / LATEST)


def file_digest(path: Path) -> dict[str, int | str]:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        for block in iter(lambda: file.read(1 << 22), b""):
            digest.update(block)
    return {"bytes": path.stat().st_size, "sha256": digest.hexdigest()}


@dataclass(frozen=True)
class ActorRecord:
    """What rebuilds the actor a checkpoint's rank files hold, as its manifest records it (the checkpoint converter,
    checkpoint_conversion.py, reads it; resume does not): the parallel layout the files were written at, Megatron's
    sizes under the trainer's names (`tensor_model_parallel_size`, ...), and the LoRA settings (`LoraConfig`'s
    fields; None: the whole model trains)."""
    parallel: dict[str, int]
    lora: dict | None


def rank_file_name(rank: int) -> str:
    return f"rank_{rank:05d}.pt"


def write_manifest(directory: Path, step: int, world_size: int, files: dict[str, dict],
                   actor: ActorRecord | None = None) -> None:
    manifest = {"step": step, "world_size": world_size, "files": files}
    if actor is not None:
        manifest["actor"] = dataclasses.asdict(actor)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def verify_checkpoint(directory: Path, world_size: int, rank_file: str) -> str | None:
    """None when `rank_file` of checkpoint `directory` matches its manifest, else what is wrong with it.

    A checkpoint written by a different number of ranks raises `CheckpointError` (no other checkpoint of the run
    would fit either). Directories written before manifests existed are accepted when the file is present."""
    path = directory / rank_file
    manifest_path = directory / MANIFEST
    if not manifest_path.is_file():
        return None if path.is_file() else f"{path} is missing"
    try:
        manifest = json.loads(manifest_path.read_text())
        expected = manifest["files"][rank_file]
    except (ValueError, KeyError, TypeError) as err:
        return f"{manifest_path} is unreadable or has no entry for {rank_file} ({type(err).__name__}: {err})"
    if manifest["world_size"] != world_size:
        raise CheckpointError(f"checkpoint {directory} was written by {manifest['world_size']} ranks, this run has "
                              f"{world_size}; resume with the same layout or set trainer.resume=disable with a new "
                              "trainer.default_local_dir (to change the layout, start from its huggingface/ export)")
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != expected["bytes"]:
        return f"{path} has {size} bytes, its manifest says {expected['bytes']} (truncated or overwritten)"
    if file_digest(path)["sha256"] != expected["sha256"]:
        return f"{path} does not match the SHA-256 in {manifest_path} (the file is damaged)"
    return None
