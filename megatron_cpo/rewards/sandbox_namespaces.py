"""The ``namespaces`` sandbox backend, the isolation boundary (see ``sandbox.py`` for the backends).

Each grading process keeps one small launcher server (``launcher_server``, ``sandbox_launcher.py``) that forks the
per-run launchers; ``run_namespaced`` hands it one program and reads the launcher's status; the probe
``namespaces_unavailable_reason`` tells whether this machine allows the backend (one real trial run).
"""
from __future__ import annotations

import functools
import json
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
from pathlib import Path

from megatron_cpo.rewards.sandbox_types import RUNNER_SOURCE, SandboxLimits, SandboxResult, classify, read_outputs

_LAUNCHER = str(Path(__file__).parent / "sandbox_launcher.py")
SANDBOX_UID_BASE = 1_000_000  # sandbox uid/gid = this + a live pid: unique, unused by anything on the host


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


def run_namespaced(program: str, stdin: str, limits: SandboxLimits, mode: str, fn_name: str | None
                   ) -> SandboxResult:
    """Run one program in a fresh jail (``sandbox_launcher.py``); RuntimeError when the launcher could not run it."""
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


@functools.cache
def namespaces_unavailable_reason() -> str | None:
    """None when the namespace backend works here (one real trial run), else why not."""
    try:
        result = run_namespaced("print(6 * 7)", "", SandboxLimits(wall_timeout_s=30.0), "stdio", None)
    except (RuntimeError, OSError) as error:
        return str(error)
    return None if result.stdout.strip() == "42" else f"trial run gave {result.status}: {result.stderr[-300:]}"
