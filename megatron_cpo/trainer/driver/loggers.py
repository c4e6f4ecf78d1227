"""Metric sinks: console (with a progress bar and ETA), JSONL, TensorBoard and Weights & Biases.

`MetricLogger` fans out to the sinks of `trainer.logger`; a missing package is an error at start. On resume from
step k every sink forgets what was logged after k (docs/trainer.md, "Loggers and resume").
"""
from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol

from megatron_cpo.progress import bar, eta_seconds, format_duration
from megatron_cpo.trainer.driver.verl_metrics import with_verl_names

logger = logging.getLogger(__name__)

CONSOLE_KEYS = ("val/acc", "reward/mean", "reward/acc", "filter/kept_prompts", "filter/num_gen_batches",
                "actor/pg_loss", "actor/kl", "actor/entropy", "actor/grad_norm", "actor/lr", "timing/step_s")


TABLES = ("completions",)  # the tables `log_table` writes


class Sink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class ConsoleSink:
    """One line per step with a progress bar, elapsed time, ETA and the headline metrics (the rest go to the file
    sinks). The ETA is the mean time per step since the first logged step (validation included) times the steps
    left; a resumed run counts from the step it resumed at."""

    def __init__(self, total_steps: int, stream=None) -> None:
        self.total_steps = max(total_steps, 1)
        self.stream = stream if stream is not None else sys.stdout  # the stdout of now, not of the first import
        self.start = time.perf_counter()
        self._first: tuple[int, float] | None = None

    def log(self, metrics: dict[str, float], step: int) -> None:
        now = time.perf_counter()
        if self._first is None:
            self._first = (step, now)
        first_step, first_time = self._first
        eta = eta_seconds(step - first_step, self.total_steps - first_step, now - first_time)
        timing = f"{now - self.start:6.0f}s"
        if step < self.total_steps:
            timing += f" ETA {format_duration(eta)}" if eta is not None else " ETA ?"
        shown = " ".join(f"{key}={metrics[key]:.4g}" for key in CONSOLE_KEYS if key in metrics)
        print(f"{bar(step, self.total_steps)} step {step}/{self.total_steps} {timing} {shown}", file=self.stream,
              flush=True)

    def close(self) -> None:
        pass


def truncate_jsonl(path: Path, resume_step: int) -> int:
    """Keep the rows of `path` logged for steps <= `resume_step` (none when it is 0: a fresh start); returns how
    many rows were dropped. A last line cut short by a kill is dropped too."""
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            step = None
        if resume_step > 0 and isinstance(step, int) and step <= resume_step:
            kept.append(line + "\n")
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(path)
    return dropped


class JsonlSink:
    """Appends `{"step": s, **metrics}` per call to `metrics.jsonl`, after dropping the rows an earlier attempt
    logged after `resume_step` (see the module docstring)."""

    def __init__(self, path: Path, resume_step: int = 0) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        dropped = truncate_jsonl(path, resume_step)
        if dropped:
            logger.warning("%s: dropped %d rows an earlier attempt logged after step %d (the step this run starts "
                           "from)", path, dropped, resume_step)
        self.file = path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        clean = {k: (v if isinstance(v, (int, float)) and math.isfinite(v) else str(v)) for k, v in metrics.items()}
        self.file.write(json.dumps({"step": step, **clean}, sort_keys=True) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoardSink:
    """Scalars under `<default_local_dir>/tensorboard` (`tensorboard --logdir <default_local_dir>/tensorboard`)."""

    def __init__(self, log_dir: Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # events at steps >= purge_step that earlier attempts wrote are hidden from TensorBoard's views
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=resume_step + 1 if resume_step > 0 else 0)

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """One W&B run per output directory: a resumed run continues the same run id (kept in `wandb_run_id`)."""

    def __init__(self, project: str, name: str, config: dict[str, Any], log_dir: Path, resume_step: int = 0) -> None:
        import wandb

        id_file = log_dir / "wandb_run_id"
        run_id = id_file.read_text().strip() if resume_step > 0 and id_file.is_file() else wandb.util.generate_id()
        id_file.write_text(run_id + "\n")
        self.run = wandb.init(project=project, name=name, config=config, dir=str(log_dir), id=run_id,
                              resume="allow")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


# sink -> (module it needs, how to install it)
SINK_PACKAGES = {"tensorboard": ("tensorboard", "pip install tensorboard  (or: pip install -e '.[tools]')"),
                 "wandb": ("wandb", "pip install wandb")}


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def sink_package_problems(sinks: list[str]) -> list[str]:
    """One line per requested sink whose package is missing, naming the install command."""
    problems = []
    for sink in sinks:
        if sink in SINK_PACKAGES and not _installed(SINK_PACKAGES[sink][0]):
            module, install = SINK_PACKAGES[sink]
            problems.append(f"trainer.logger includes {sink!r} but the {module!r} package is not installed; "
                            f"{install}, or remove {sink!r} from trainer.logger")
    return problems


def require_sink_packages(sinks: list[str]) -> None:
    """Raise a one-line error naming the install command for every requested sink whose package is missing."""
    problems = sink_package_problems(sinks)
    if problems:
        raise ValueError("; ".join(problems))


class MetricLogger:
    """Fans metrics out to the configured sinks; `log_table` writes completion tables as JSONL. With `verl_names`
    the file and dashboard sinks also get verl's names for the same metrics (verl_metrics.py; not the console)."""

    def __init__(self, sinks: list[str], out_dir: Path, total_steps: int, project: str, name: str,
                 config: dict[str, Any], verl_names: bool = False, val_samples: int = 1,
                 resume_step: int = 0) -> None:
        require_sink_packages(sinks)
        self.out_dir = out_dir
        self.verl_names = verl_names
        self.val_samples = val_samples
        out_dir.mkdir(parents=True, exist_ok=True)
        for table in TABLES:  # forget the rows an earlier attempt logged after resume_step
            truncate_jsonl(out_dir / f"{table}.jsonl", resume_step)
        self.sinks: list[Sink] = []
        for sink in sinks:
            if sink == "console":
                self.sinks.append(ConsoleSink(total_steps))
            elif sink == "jsonl":
                self.sinks.append(JsonlSink(out_dir / "metrics.jsonl", resume_step))
            elif sink == "tensorboard":
                self.sinks.append(TensorBoardSink(out_dir / "tensorboard", resume_step))
            elif sink == "wandb":
                self.sinks.append(WandbSink(project, name, config, out_dir, resume_step))
            else:
                raise ValueError(f"trainer.logger entry {sink!r} is not a sink; use console, jsonl, tensorboard or "
                                 "wandb")

    def log(self, metrics: dict[str, float], step: int) -> None:
        extended = with_verl_names(metrics, step, self.val_samples) if self.verl_names else metrics
        for sink in self.sinks:
            sink.log(metrics if isinstance(sink, ConsoleSink) else extended, step)

    def log_table(self, name: str, rows: list[dict[str, Any]], step: int) -> None:
        """Append rows (e.g. prompt / completion / reward) tagged with the step to `<name>.jsonl` (`name` in
        TABLES, so a resumed run cuts it back too)."""
        path = self.out_dir / f"{name}.jsonl"
        with path.open("a", encoding="utf-8") as file:
            for row in rows:
                file.write(json.dumps({"step": step, **row}, ensure_ascii=False) + "\n")

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
