"""The weak ``process`` sandbox backend: rlimits, an empty environment, ``PR_SET_PDEATHSIG``, its own session (killed
after the run) and a throwaway directory; as root also a fresh uid with ``no_new_privs``, whose every process a
helper kills afterwards with ``kill(-1, SIGKILL)``, daemons included. Not an isolation boundary: the host's files
and network stay in view (docs/sandbox.md).
"""
from __future__ import annotations

import ctypes
import itertools
import os
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from megatron_cpo.rewards.sandbox_types import (
    RUNNER_SOURCE,
    SandboxLimits,
    SandboxResult,
    classify,
    read_outputs,
)

_PR_SET_PDEATHSIG, _PR_SET_NO_NEW_PRIVS = 1, 38
_libc = ctypes.CDLL(None, use_errno=True)
_PROCESS_UID_BASE = 100_000_000  # uid = base + 64 * grader pid + run counter: unique per concurrent run, and apart
_run_counter = itertools.count()  # from the namespace backend's uids (1,000,000 + pid)


def _fresh_uid() -> int | None:
    """An unused uid for this run when the grader is root, else None (the program keeps the grader's uid)."""
    return _PROCESS_UID_BASE + 64 * os.getpid() + next(_run_counter) % 64 if os.geteuid() == 0 else None


def _child_setup(limits: SandboxLimits, uid: int | None) -> None:
    """Runs in the forked child before exec."""
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for name, value in limits.rlimits().items():
        resource.setrlimit(getattr(resource, name), (value, value if name != "RLIMIT_CPU" else value + 1))
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _live_processes_of(uid: int) -> list[int]:
    """Pids of the non-zombie processes whose real uid is ``uid`` (read from ``/proc``)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                status = Path(f"/proc/{entry}/status").read_text()
            except OSError:
                continue
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            if fields.get("Uid", "").split()[:1] == [str(uid)] and not fields.get("State", "").strip().startswith("Z"):
                found.append(int(entry))
    return found


def _kill_every_process_of(uid: int) -> None:
    """SIGKILL all processes of ``uid`` from a helper running as that uid (``kill(-1)`` reaches exactly those, and
    not the helper), until none is left alive."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        helper = os.fork()
        if helper == 0:
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                os.kill(-1, signal.SIGKILL)
            finally:
                os._exit(0)
        os.waitpid(helper, 0)
        if not _live_processes_of(uid):
            return
        time.sleep(0.01)


def run_in_process(program: str, stdin: str, limits: SandboxLimits, mode: str, fn_name: str | None
                   ) -> SandboxResult:
    directory = Path(tempfile.mkdtemp(prefix="mcpo-sandbox-"))
    workdir = directory / "work"
    workdir.mkdir()
    uid = _fresh_uid()
    try:
        (workdir / "solution.py").write_text(program, encoding="utf-8")
        (directory / "stdin.txt").write_text(stdin, encoding="utf-8")
        command = [os.path.realpath(limits.python_executable), "-I", "-S", "-B", "-c", RUNNER_SOURCE, mode,
                   "solution.py", *([fn_name] if fn_name else [])]
        if uid is not None:
            os.chown(workdir, uid, uid)
        started = time.monotonic()
        with open(directory / "stdin.txt", "rb") as stdin_file, open(directory / "stdout.txt", "wb") as out, \
                open(directory / "stderr.txt", "wb") as err:
            try:
                child = subprocess.Popen(command, cwd=workdir, env={}, stdin=stdin_file, stdout=out, stderr=err,
                                         start_new_session=True, preexec_fn=lambda: _child_setup(limits, uid))
            except PermissionError as error:
                raise RuntimeError(f"the process sandbox's unprivileged uid cannot run {command[0]} ({error}); "
                                   "point SandboxLimits.python_executable at an interpreter every user may run, "
                                   "e.g. /usr/bin/python3") from error
            timed_out = False
            try:
                child.wait(timeout=limits.wall_timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:
                    os.killpg(child.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                child.wait()
                if uid is not None:
                    _kill_every_process_of(uid)
        stdout, stderr, output_full = read_outputs(directory, limits)
        return SandboxResult(classify(child.returncode, timed_out, stderr, output_full), child.returncode, stdout,
                             stderr, time.monotonic() - started)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
