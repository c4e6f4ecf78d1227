"""Run untrusted Python (model-written code) behind an operating-system boundary.

Backends, chosen by ``reward.sandbox.mode`` (``configure_sandbox``):

- ``namespaces`` (the boundary): ``sandbox_launcher.py`` runs each program as a fresh unprivileged uid/gid in its
  own PID, mount, IPC, UTS and network namespaces, with ``no_new_privs``, an empty environment, a private tmpfs
  ``/work``, only ``/usr`` and the interpreter visible (read-only), no network at all, rlimits (CPU time, address
  space, file size, open files, processes) and PID-namespace teardown: when the call returns or times out, every
  process the program started is gone. Needs root (or ``CAP_SYS_ADMIN``) in the grading process. Each grading
  process keeps one small launcher server (``launcher_server``) that forks the per-run launchers.
- ``remote``: a SandboxFusion service (``reward.sandbox.fusion_url``; ``sandbox_fusion.py``); its isolation is the
  service's.
- ``process`` (weak, a fallback to be chosen knowingly): a child process with the same rlimits, an empty
  environment, a throwaway working directory, its own session, and -- when the grader runs as root -- a fresh
  unprivileged uid whose every process is SIGKILLed after the call. It sees the host's filesystem (what that uid may
  read or write: world-writable directories included) and network. Without root it runs as the grader's own user
  and can read and signal the grader's processes. Choosing it logs a warning and sets ``reward/sandbox_weak``.
- ``auto`` (default): ``remote`` when a SandboxFusion URL is configured, else ``namespaces`` when this machine
  allows them (probed once per process), else ``process`` with the warning. The choice is logged.

No Python-level guard (audit hook, restricted builtins) is part of the boundary: those can be switched off from
inside the interpreter they guard.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)
MODES = ("auto", "namespaces", "process", "remote")
RUNNER_SOURCE = (Path(__file__).parent / "sandbox_runner.py").read_text(encoding="utf-8")
_LAUNCHER = str(Path(__file__).parent / "sandbox_launcher.py")
SANDBOX_UID_BASE = 1_000_000  # sandbox uid/gid = this + a live pid: unique, unused by anything on the host


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
    """`reward.sandbox.*`: which backend runs model-written code (see the module docstring). `mode`: `namespaces`
    (the isolation boundary; needs root or CAP_SYS_ADMIN), `remote` (a SandboxFusion service at `fusion_url`),
    `process` (rlimits and a throwaway uid only, NOT a boundary: logs a warning and `reward/sandbox_weak=1`) or
    `auto` (remote when a URL is set, else namespaces when this machine allows them, else process; logged).
    `fusion_url` is the `run_code` endpoint (e.g. `http://host:8080/run_code`), `fusion_max_concurrent` the
    requests in flight per grading worker (the test cases of one sample run in parallel), `fusion_memory_limit_mb`
    the limit per program. verl's `reward_model.sandbox_fusion.{url,max_concurrent,memory_limit_mb}` (and
    `reward.sandbox_fusion.*`) are accepted as aliases of the `fusion_*` keys."""

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


_settings = SandboxConfig()


def configure_sandbox(settings: SandboxConfig, resolve: bool = True) -> str | None:
    """Set the backend every later ``run_python`` call of this process uses; returns the resolved mode (``resolve``
    False leaves ``auto``'s probe to the first run)."""
    global _settings
    _settings = settings
    return active_mode() if resolve else None


def current_settings() -> SandboxConfig:
    return _settings


def active_mode() -> str:
    """The backend in use: ``namespaces``, ``process`` or ``remote`` (``auto`` resolved, and logged once)."""
    return _resolve(_settings.mode, bool(_settings.fusion_url))


@functools.cache
def _resolve(mode: str, has_url: bool) -> str:
    if mode == "auto":
        reason = namespaces_unavailable_reason()
        mode = "remote" if has_url else ("namespaces" if reason is None else "process")
        logger.info("code sandbox: reward.sandbox.mode=auto runs the %r backend", mode)
    elif mode == "namespaces" and (reason := namespaces_unavailable_reason()) is not None:
        raise RuntimeError(f"reward.sandbox.mode=namespaces, but this machine refuses them ({reason}); run the "
                           "grader as root (or with CAP_SYS_ADMIN), or set reward.sandbox.mode=remote with "
                           "reward.sandbox.fusion_url, or knowingly reward.sandbox.mode=process")
    if mode == "process":
        logger.warning(
            "CODE SANDBOX IS WEAK: reward.sandbox.mode resolved to 'process' (no namespaces here: %s). Model-written "
            "code runs with rlimits only and can see this machine's files and network%s. Use "
            "reward.sandbox.mode=namespaces (root / CAP_SYS_ADMIN) or remote (reward.sandbox.fusion_url) for "
            "untrusted code; reward/sandbox_weak=1 is logged every step.", namespaces_unavailable_reason(),
            "" if os.geteuid() == 0 else ", and as the trainer's own user, can read and signal its processes")
    return mode


def sandbox_metrics() -> dict[str, float]:
    """``reward/sandbox_weak``: 1 when code runs in the weak process mode."""
    return {"reward/sandbox_weak": float(active_mode() == "process")}


@functools.cache
def namespaces_unavailable_reason() -> str | None:
    """None when the namespace backend works here (one real trial run), else why not."""
    try:
        result = _run_namespaced("print(6 * 7)", "", SandboxLimits(wall_timeout_s=30.0), "stdio", None)
    except (RuntimeError, OSError) as error:
        return str(error)
    return None if result.stdout.strip() == "42" else f"trial run gave {result.status}: {result.stderr[-300:]}"


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


def _interpreter(limits: SandboxLimits) -> tuple[str, list[str]]:
    """The real interpreter binary (not a venv link: the program gets the bare standard library) and the
    directories the namespace jail must show read-only for it to start."""
    binary = os.path.realpath(limits.python_executable)
    prefix = os.path.dirname(os.path.dirname(binary))
    return binary, [] if prefix == "/usr" or prefix.startswith("/usr/") else [prefix]


class _LauncherServer:
    """This process's ``sandbox_launcher.py`` server, started on first use and again after a fork or its death."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner, self._socket, self._process = -1, None, None

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._process = subprocess.Popen([sys.executable, "-I", "-S", "-B", _LAUNCHER, str(theirs.fileno())],
                                         pass_fds=(theirs.fileno(),), env={}, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        theirs.close()
        self._owner, self._socket = os.getpid(), ours

    def submit(self, settings: dict, fds: tuple[int, int, int, int]) -> None:
        """Hand one run to the server: ``fds`` become the launcher's stdin, stdout, stderr and status pipe."""
        message = json.dumps(settings).encode()
        with self._lock:
            for attempt in range(2):
                if self._owner != os.getpid() or self._process.poll() is not None:
                    self._start()
                try:
                    socket.send_fds(self._socket, [message], list(fds))
                    return
                except OSError:
                    if attempt:
                        raise
                    self._owner = -1

    def pid(self) -> int | None:
        """The server's pid in this process, if one runs."""
        return self._process.pid if self._process is not None and self._owner == os.getpid() else None


launcher_server = _LauncherServer()


def _read_status(status_read: int, backstop_s: float) -> list[str]:
    """The launcher's last status line, read until every writer has closed the pipe (the launcher and the init
    have exited, and with the init the whole sandbox). The launcher enforces the wall time; past ``backstop_s``
    it is SIGKILLed here (its init follows through the parent-death signal)."""
    received, killed, deadline = b"", False, time.monotonic() + backstop_s
    while True:
        wait_s = None if killed else max(0.0, deadline - time.monotonic())
        if not select.select([status_read], [], [], wait_s)[0]:
            first = received.split(b"\n", 1)
            if len(first) < 2 or not first[0].startswith(b"launcher "):
                break  # no launcher ever started
            os.kill(int(first[0].split()[1]), signal.SIGKILL)
            killed = True
            continue
        chunk = os.read(status_read, 4096)
        if not chunk:
            break
        received += chunk
    lines = [line.split() for line in received.decode().splitlines() if line.strip()]
    return lines[-1] if lines else []


def _run_namespaced(program: str, stdin: str, limits: SandboxLimits, mode: str, fn_name: str | None
                    ) -> SandboxResult:
    directory = Path(tempfile.mkdtemp(prefix="mcpo-sandbox-"))
    status_read, status_write = os.pipe()
    try:
        (directory / "root").mkdir()
        (directory / "program.py").write_text(program, encoding="utf-8")
        (directory / "stdin.txt").write_text(stdin, encoding="utf-8")
        binary, read_only = _interpreter(limits)
        settings = {"root_dir": str(directory / "root"), "program_path": str(directory / "program.py"),
                    "read_only_paths": ["/usr", *read_only], "uid_base": SANDBOX_UID_BASE,
                    "work_dir_mb": limits.work_dir_mb, "rlimits": limits.rlimits(), "status_fd": 3,
                    "wall_timeout_s": limits.wall_timeout_s,
                    "argv": [binary, "-I", "-S", "-B", "-c", RUNNER_SOURCE, mode, "solution.py",
                             *([fn_name] if fn_name else [])]}
        started = time.monotonic()
        with open(directory / "stdin.txt", "rb") as stdin_file, open(directory / "stdout.txt", "wb") as out, \
                open(directory / "stderr.txt", "wb") as err:
            launcher_server.submit(settings, (stdin_file.fileno(), out.fileno(), err.fileno(), status_write))
        os.close(status_write)
        status_write = -1
        report = _read_status(status_read, limits.wall_timeout_s + 30.0)
        wall_s = time.monotonic() - started
        if not report or report[0] not in ("exit", "signal", "timeout"):
            detail = " ".join(report[1:]) if report[:1] == ["error"] else "the launcher ended without a status"
            raise RuntimeError(f"the namespace sandbox could not run the program: {detail}")
        stdout, stderr, output_full = read_outputs(directory, limits)
        timed_out = report[0] == "timeout"
        returncode = None if timed_out else (int(report[1]) if report[0] == "exit" else -int(report[1]))
        return SandboxResult(classify(returncode, timed_out, stderr, output_full), returncode, stdout, stderr,
                             wall_s)
    finally:
        for descriptor in (status_read, status_write):
            if descriptor >= 0:
                os.close(descriptor)
        shutil.rmtree(directory, ignore_errors=True)


def run_python(program: str, stdin: str = "", *, limits: SandboxLimits | None = None, mode: str = "stdio",
               fn_name: str | None = None, backend: str | None = None) -> SandboxResult:
    """Run ``program`` once in the configured sandbox (``backend`` overrides it for this call). mode ``stdio`` feeds
    ``stdin``; mode ``call`` calls ``fn_name`` with the JSON argument list in ``stdin`` and returns its JSON result
    on stdout."""
    if mode not in ("stdio", "call") or (mode == "call" and not fn_name):
        raise ValueError(f"run_python mode={mode!r}, fn_name={fn_name!r}: use mode='stdio', or 'call' with fn_name")
    limits = limits or SandboxLimits()
    backend = backend or active_mode()
    if backend == "namespaces":
        return _run_namespaced(program, stdin, limits, mode, fn_name)
    if backend == "process":
        from megatron_cpo.rewards.sandbox_process import run_in_process

        return run_in_process(program, stdin, limits, mode, fn_name)
    if backend == "remote":
        from megatron_cpo.rewards.sandbox_fusion import run_remote

        return run_remote(program, stdin, limits, mode, fn_name, _settings)
    raise ValueError(f"sandbox backend={backend!r}; choose namespaces, process or remote")
