"""The code sandbox's types and settings, shared by its backends and the dispatcher above them (``sandbox.py``).

A leaf module (standard library only): the limits of one run, its result and how a run's end is classified, the
``reward.sandbox.*`` settings, and the harness source every backend runs the program with (``sandbox_runner.py``).
"""
from __future__ import annotations

import signal
import sys
from dataclasses import dataclass
from pathlib import Path

MODES = ("auto", "namespaces", "process", "remote")
RUNNER_SOURCE = (Path(__file__).parent / "sandbox_runner.py").read_text(encoding="utf-8")


@dataclass
class SandboxLimits:
    """Per-run limits. ``wall_timeout_s`` bounds real time, ``cpu_time_s`` CPU time, both per test case;
    ``work_dir_mb`` the private scratch directory (namespaces mode)."""

    wall_timeout_s: float = 4.0
    cpu_time_s: int = 3
    memory_mb: int = 512
    output_limit_bytes: int = 1 << 20
    max_open_files: int = 64
    max_processes: int = 32
    work_dir_mb: int = 16
    python_executable: str = sys.executable

    def __post_init__(self) -> None:
        if self.wall_timeout_s <= 0 or self.cpu_time_s <= 0:
            raise ValueError(f"sandbox time limits must be > 0, got wall_timeout_s={self.wall_timeout_s}, "
                             f"cpu_time_s={self.cpu_time_s}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox memory_mb={self.memory_mb} is too small for a Python interpreter; use >= 64")
        if self.output_limit_bytes < 1024:
            raise ValueError(f"sandbox output_limit_bytes={self.output_limit_bytes}; use >= 1024")
        if self.max_processes < 1 or self.max_open_files < 16 or self.work_dir_mb < 1:
            raise ValueError(f"sandbox max_processes={self.max_processes} (>= 1), max_open_files="
                             f"{self.max_open_files} (>= 16), work_dir_mb={self.work_dir_mb} (>= 1) out of range")

    def rlimits(self) -> dict[str, int]:
        """The resource limits of the program, by ``resource`` constant name (CPU's hard limit is one above)."""
        return {"RLIMIT_CPU": self.cpu_time_s, "RLIMIT_AS": self.memory_mb << 20,
                "RLIMIT_FSIZE": self.output_limit_bytes, "RLIMIT_NOFILE": self.max_open_files,
                "RLIMIT_NPROC": self.max_processes, "RLIMIT_CORE": 0}


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ok, runtime_error, timeout, cpu_limit, memory_limit, output_limit."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


@dataclass(frozen=True)
class SandboxConfig:
    """`reward.sandbox.*`: which backend runs model-written code (docs/sandbox.md). `mode`: `namespaces` (the boundary;
    needs root or CAP_SYS_ADMIN), `remote` (SandboxFusion at `fusion_url`), `process` (NOT a boundary; logs a
    warning and `reward/sandbox_weak=1`) or `auto`. `fusion_url` is the `run_code` endpoint, `fusion_max_concurrent`
    the requests in flight per grading worker, `fusion_memory_limit_mb` the limit per program (verl's
    `reward_model.sandbox_fusion.*` are aliases of the `fusion_*` keys).
    """

    mode: str = "auto"
    fusion_url: str = ""
    fusion_max_concurrent: int = 64
    fusion_memory_limit_mb: int = 1024

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"reward.sandbox.mode={self.mode!r} is not supported; choose one of "
                             f"{', '.join(map(repr, MODES))}")
        if self.mode == "remote" and not self.fusion_url:
            raise ValueError("reward.sandbox.mode=remote needs reward.sandbox.fusion_url (e.g. "
                             "http://host:8080/run_code)")
        if self.fusion_max_concurrent < 1:
            raise ValueError(f"reward.sandbox.fusion_max_concurrent={self.fusion_max_concurrent} must be >= 1")
        if self.fusion_memory_limit_mb < 64:
            raise ValueError(f"reward.sandbox.fusion_memory_limit_mb={self.fusion_memory_limit_mb} must be >= 64 (a "
                             "Python interpreter needs about that)")


def classify(returncode: int | None, timed_out: bool, stderr: str, output_full: bool) -> str:
    """A run's status from how it ended."""
    if timed_out:
        return "timeout"
    if returncode == -signal.SIGXFSZ or output_full or "File too large" in stderr:
        return "output_limit"
    if returncode == 0:
        return "ok"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu_limit"
    if "MemoryError" in stderr or returncode == -signal.SIGSEGV:
        return "memory_limit"
    return "runtime_error"


def read_outputs(directory: Path, limits: SandboxLimits) -> tuple[str, str, bool]:
    """(stdout, the tail of stderr, whether stdout reached the output limit) from the run's output files."""
    raw_stdout = (directory / "stdout.txt").read_bytes()
    stderr = (directory / "stderr.txt").read_bytes()[-4096:].decode("utf-8", "replace")
    return raw_stdout.decode("utf-8", "replace"), stderr, len(raw_stdout) >= limits.output_limit_bytes
