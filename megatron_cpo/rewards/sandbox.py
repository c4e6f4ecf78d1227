"""Run untrusted Python in a contained child process.

What is enforced, and by what:

- Operating system, always: a fresh session and process group (the whole group is SIGKILLed on timeout and after
  every run), ``RLIMIT_CPU`` (CPU seconds), ``RLIMIT_AS`` (memory), ``RLIMIT_FSIZE`` (stdout and stderr go to files,
  so this caps output: a flood dies of SIGXFSZ), ``RLIMIT_NOFILE``, ``RLIMIT_CORE=0``, ``RLIMIT_NPROC`` (the kernel
  ignores it for root), ``PR_SET_PDEATHSIG`` (the child dies with its parent), a cleared environment, a throwaway
  working directory deleted afterwards, and ``python -I -S`` (no site-packages, no PYTHON* variables).
- Operating system, where the kernel allows it (root, or unprivileged user namespaces): a new, empty network
  namespace, so no socket can reach any host, loopback included. ``network_namespace_mode()`` says which applies.
- Python audit hook (``sandbox_guard.py``), always: refuses sockets, ctypes, process creation, writes outside the
  working directory and reads outside it and the standard library (other processes' ``/proc`` entries included).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

_GUARD_SOURCE = (Path(__file__).parent / "sandbox_guard.py").read_text(encoding="utf-8")
_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_PR_SET_PDEATHSIG = 1


@dataclass
class SandboxLimits:
    """Per-run limits. ``wall_timeout_s`` bounds real time, ``cpu_time_s`` CPU time, both per test case."""

    wall_timeout_s: float = 4.0
    cpu_time_s: int = 3
    memory_mb: int = 512
    output_limit_bytes: int = 1 << 20
    max_open_files: int = 64
    max_processes: int = 32
    isolate_network: bool = True
    python_executable: str = sys.executable

    def __post_init__(self) -> None:
        if self.wall_timeout_s <= 0 or self.cpu_time_s <= 0:
            raise ValueError(f"sandbox time limits must be > 0, got wall_timeout_s={self.wall_timeout_s}, "
                             f"cpu_time_s={self.cpu_time_s}")
        if self.memory_mb < 64:
            raise ValueError(f"sandbox memory_mb={self.memory_mb} is too small for a Python interpreter; use >= 64")
        if self.output_limit_bytes < 1024:
            raise ValueError(f"sandbox output_limit_bytes={self.output_limit_bytes}; use >= 1024")


@dataclass
class SandboxResult:
    """Outcome of one run. ``status``: ok, runtime_error, timeout, cpu_limit, memory_limit, output_limit."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _try_unshare_network() -> bool:
    libc = _libc()
    if libc.unshare(_CLONE_NEWNET) == 0:
        return True
    return libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0


@functools.cache
def network_namespace_mode() -> str:
    """``"namespace"`` if children can get an empty network namespace here, else ``"audit_hook"``."""
    probe = subprocess.run([sys.executable, "-I", "-S", "-c", "pass"], preexec_fn=_probe_unshare,
                           capture_output=True, check=False)
    return "namespace" if probe.returncode == 0 else "audit_hook"


def _probe_unshare() -> None:
    if not _try_unshare_network():
        os._exit(3)


def _child_setup(limits: SandboxLimits, use_network_namespace: bool) -> None:
    """Runs in the forked child before exec: namespaces, death signal, resource limits."""
    if use_network_namespace and not _try_unshare_network():
        os._exit(125)
    _libc().prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    memory = limits.memory_mb << 20
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_time_s, limits.cpu_time_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.output_limit_bytes, limits.output_limit_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.max_open_files, limits.max_open_files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.max_processes, limits.max_processes))


def _kill_group(process_group: int) -> None:
    try:
        os.killpg(process_group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _classify(returncode: int | None, timed_out: bool, stderr: str, output_full: bool) -> str:
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


def run_python(program: str, stdin: str = "", *, limits: SandboxLimits | None = None, mode: str = "stdio",
               fn_name: str | None = None) -> SandboxResult:
    """Run ``program`` in a fresh sandbox. mode ``stdio`` feeds ``stdin``; mode ``call`` calls ``fn_name`` with the
    JSON argument list in ``stdin`` and returns its JSON result on stdout."""
    if mode not in ("stdio", "call") or (mode == "call" and not fn_name):
        raise ValueError(f"run_python mode={mode!r}, fn_name={fn_name!r}: use mode='stdio', or 'call' with fn_name")
    limits = limits or SandboxLimits()
    use_namespace = limits.isolate_network and network_namespace_mode() == "namespace"
    _libc()  # load libc here: the forked child must not dlopen between fork and exec
    workdir = Path(tempfile.mkdtemp(prefix="mcpo-sandbox-"))
    try:
        (workdir / "solution.py").write_text(program, encoding="utf-8")
        (workdir / "stdin.txt").write_text(stdin, encoding="utf-8")
        command = [limits.python_executable, "-I", "-S", "-c", _GUARD_SOURCE, mode, "solution.py"]
        command += [fn_name] if fn_name else []
        started = time.monotonic()
        with open(workdir / "stdin.txt", "rb") as stdin_file, open(workdir / "stdout.txt", "wb") as stdout_file, \
                open(workdir / "stderr.txt", "wb") as stderr_file:
            child = subprocess.Popen(
                command, cwd=workdir, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "PYTHONHASHSEED": "0"},
                stdin=stdin_file, stdout=stdout_file, stderr=stderr_file, close_fds=True, start_new_session=True,
                preexec_fn=functools.partial(_child_setup, limits, use_namespace),
            )
            timed_out = False
            try:
                child.wait(timeout=limits.wall_timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(child.pid)
                child.wait()
        wall_s = time.monotonic() - started
        raw_stdout = (workdir / "stdout.txt").read_bytes()
        stdout = raw_stdout.decode("utf-8", "replace")
        stderr = (workdir / "stderr.txt").read_bytes()[-4096:].decode("utf-8", "replace")
        status = _classify(child.returncode, timed_out, stderr, len(raw_stdout) >= limits.output_limit_bytes)
        return SandboxResult(status, child.returncode, stdout, stderr, wall_s)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
