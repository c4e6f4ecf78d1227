"""The operating-system processes behind the engine actors, so none outlives the manager that started them.

Each engine actor writes `<host> <pid>` to a file in the manager's directory as its first act. When the manager shuts
down, the processes those actors started on this host (vLLM's engine core and its workers) are looked up before the
actors are killed (which would orphan them) and ended afterwards, so a manager stopped in the middle of start-up
(SIGTERM) leaves nothing running.
"""
from __future__ import annotations

import socket
from pathlib import Path

import psutil


def engine_processes(pid_dir: Path, pattern: str = "*.pid") -> list[psutil.Process]:
    """The processes started by the engine actors whose pid files in `pid_dir` (those matching `pattern`: one
    engine's, or all) name this host."""
    found: list[psutil.Process] = []
    for pid_file in pid_dir.glob(pattern):
        try:
            host, _, pid = pid_file.read_text().partition(" ")
        except OSError:
            continue
        if host != socket.gethostname():
            continue
        try:
            found += psutil.Process(int(pid)).children(recursive=True)
        except (psutil.Error, ValueError):
            continue
    return found


def end_processes(processes: list[psutil.Process], grace_s: float) -> None:
    """Terminate the given processes that still run (a stopped one is continued, so that it receives the signal),
    then kill the ones that outlive `grace_s` seconds."""
    alive = [process for process in processes if process.is_running()]
    for process in alive:
        try:
            process.terminate()
            process.resume()
        except psutil.Error:
            pass
    _, still = psutil.wait_procs(alive, timeout=grace_s)
    for process in still:
        try:
            process.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(still, timeout=grace_s)
