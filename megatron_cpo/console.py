"""What a run prints to the console and what only its log file keeps.

The console gets this package's INFO and every library's warnings and errors, less known noise no user can act on
(Megatron-Core's INFO, `QUIET_WARNINGS`); the log file gets everything at INFO and above. Bad input to a command is
one `error: ...` line, not a traceback (`run_reporting_errors`).
"""
from __future__ import annotations

import argparse
import logging
import logging.handlers
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

PACKAGE = "megatron_cpo"

# (warning category name, message pattern): raised by libraries on every run, kept in the log file only.
QUIET_WARNINGS: tuple[tuple[str, str], ...] = (
    # Megatron's optimizer reads `.grad` of a non-leaf view of the main grads (harmless; torch warns every step).
    ("UserWarning", r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"),
    # torch 2.13 deprecates the c10d collective names Megatron-Core 0.16 calls.
    ("FutureWarning", r"`torch\.distributed\.\w+` is deprecated"),
    ("FutureWarning", r"torch\.cuda\.amp\.\w+\(args\.\.\.\)` is deprecated"),
    ("FutureWarning", r"`torch\.cuda\.amp\.custom_(fwd|bwd)"),
    # Megatron-Core 0.16's torch_dist checkpoint loading calls APIs torch 2.13 deprecates.
    ("FutureWarning", r"`load_state_dict` is deprecated and will be removed"),
    ("FutureWarning", r"Please use DTensor instead and we are deprecating ShardedTensor"),
    # Megatron-Core 0.16 warns whenever selective recompute covers the core attention (recompute_granularity
    # selective), even without Transformer Engine, where the local attention is exactly what it should recompute.
    ("UserWarning", r"If you are using transformer_engine as the transformer implementation, the core_attn"),
)

_WARNING_LINE = re.compile(r"^\S+:\d+: (\w+): (.*)", re.DOTALL)
_installed_handlers: list[logging.Handler] = []


def _is_ours(logger_name: str) -> bool:
    return logger_name == PACKAGE or logger_name.startswith(PACKAGE + ".")


def is_quiet_warning(message: str) -> bool:
    """Whether a `py.warnings` record (formatted `file:line: Category: text`) is one of `QUIET_WARNINGS`."""
    match = _WARNING_LINE.match(message)
    if match is None:
        return False
    category, text = match.groups()
    return any(category == name and re.search(pattern, text) for name, pattern in QUIET_WARNINGS)


class ConsoleFilter(logging.Filter):
    """Passes this package's INFO and up, other loggers' WARNING and up, minus `QUIET_WARNINGS`."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "py.warnings":
            return not is_quiet_warning(record.getMessage())
        if _is_ours(record.name):
            return record.levelno >= logging.INFO
        return record.levelno >= logging.WARNING


class ConsoleFormatter(logging.Formatter):
    """`HH:MM:SS message` for this package's INFO lines; level and logger name for anything louder or foreign."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
        self._brief = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def format(self, record: logging.LogRecord) -> str:
        if record.levelno < logging.WARNING and _is_ours(record.name):
            return self._brief.format(record)
        return super().format(record)


class RunLogHandler(logging.handlers.WatchedFileHandler):
    """The run's log file, reopened by path (parent folder recreated) when it was moved or deleted under the running
    process, e.g. when the run directory of an earlier run is archived at start-up."""

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def remove_logging() -> None:
    """Take the handlers `setup_logging` installed off the root logger: a host that runs the CLI in its own process (a
    notebook, the test suite) keeps no handler on a stream it has since closed."""
    root = logging.getLogger()
    while _installed_handlers:
        handler = _installed_handlers.pop()
        root.removeHandler(handler)
        handler.close()


def setup_logging(log_file: Path | str | None = None, stream: TextIO | None = None) -> Path | None:
    """Route logging and Python warnings: filtered to `stream` (stderr), everything to `log_file` when given.
    Replaces handlers an earlier call installed on the root logger; returns the log file's path."""
    root = logging.getLogger()
    remove_logging()
    root.setLevel(logging.INFO)
    console = logging.StreamHandler(stream if stream is not None else sys.stderr)
    console.addFilter(ConsoleFilter())
    console.setFormatter(ConsoleFormatter())
    handlers: list[logging.Handler] = [console]
    path = None
    if log_file is not None:
        path = Path(log_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        file_handler = RunLogHandler(path, encoding="utf-8")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        handlers.append(file_handler)
    for handler in handlers:
        root.addHandler(handler)
    _installed_handlers.extend(handlers)
    logging.captureWarnings(True)
    return path


# Errors that mean bad input, not a bug: reported as one line instead of a traceback.
USER_ERRORS = (FileExistsError, FileNotFoundError, ValueError)


def run_reporting_errors(run: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> None:
    """Run a command; on bad input print `error: ...` and exit with status 2."""
    try:
        run(args)
    except USER_ERRORS as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(2)


def run_log_path(out_dir: Path | str) -> Path:
    """`<out_dir>/train.log` on rank 0, `train.rank<r>.log` on the other torchrun ranks."""
    rank = int(os.environ.get("RANK", "0") or 0)
    return Path(out_dir) / ("train.log" if rank == 0 else f"train.rank{rank}.log")
