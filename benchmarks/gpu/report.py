"""Results of the GPU check: one JSON-lines file per part while it runs, then `results.json` and `results.md`.

Each part appends one record (a flat dict) per measurement as soon as it has it, so a part stopped by the time guard
still leaves what it measured. The writers here are plain functions over those records (tested on CPU).
"""
from __future__ import annotations

import datetime
import json
import platform
import subprocess
from collections.abc import Callable, Iterable
from importlib import metadata
from pathlib import Path
from typing import Any

Column = tuple[str, str, Callable[[Any], str]]  # header, record key, formatter


def append_record(path: str | Path, record: dict) -> None:
    """Append one record to a JSON-lines file (flushed at once: a killed part keeps every line written)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()


def read_records(path: str | Path) -> list[dict]:
    """The records of a JSON-lines file; a missing file or a torn last line (killed writer) yields what is complete."""
    records = []
    path = Path(path)
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return records


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def environment() -> dict:
    """Device, driver and library versions, date: what every results table states."""
    import torch

    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or None
    except OSError:  # no git on the machine (a copied working tree)
        commit = None
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
        "driver": _driver() if cuda else None,
        "cuda": torch.version.cuda, "torch": torch.__version__, "triton": _version("triton"),
        "python": platform.python_version(), "megatron_core": _version("megatron-core"),
        "liger_kernel": _version("liger-kernel"), "transformers": _version("transformers"),
        "git_commit": commit,
    }


def fmt(digits: int) -> Callable[[Any], str]:
    """Formatter: a number with `digits` decimals, blank for None."""
    return lambda value: "" if value is None else (f"{value:.{digits}f}" if isinstance(value, (int, float))
                                                   and not isinstance(value, bool) else str(value))


def text(value: Any) -> str:
    return "" if value is None else str(value).replace("|", "/").replace("\n", " ")


def markdown_table(records: Iterable[dict], columns: list[Column]) -> str:
    """A Markdown table with one row per record; missing keys are blank."""
    lines = ["| " + " | ".join(header for header, _, _ in columns) + " |", "|" + "---|" * len(columns)]
    for record in records:
        lines.append("| " + " | ".join(render(record.get(key)) for _, key, render in columns) + " |")
    return "\n".join(lines)


def write_results(out_dir: str | Path, summary: dict, tables: dict[str, str]) -> tuple[Path, Path]:
    """Write `results.json` (the whole summary) and `results.md` (environment, part status, one table per part)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "results.json", out / "results.md"
    json_path.write_text(json.dumps(summary, indent=1) + "\n")
    env = summary.get("environment", {})
    lines = [f"# GPU check: {env.get('device', '?')}", "",
             "| " + " | ".join(env) + " |", "|" + "---|" * len(env),
             "| " + " | ".join(text(v) for v in env.values()) + " |", "",
             f"Command: `{summary.get('command', '')}`", "",
             markdown_table(({"part": name, **part} for name, part in summary.get("parts", {}).items()),
                            [("part", "part", text), ("status", "status", text), ("seconds", "seconds", fmt(1)),
                             ("budget s", "budget_s", fmt(0)), ("note", "note", text)])]
    for name, table in tables.items():
        lines += ["", f"## {name}", "", table]
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path
