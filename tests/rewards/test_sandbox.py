"""Hostile programs in the code sandbox: each is contained, fails, and leaves no process behind.

What contains each one (see ``megatron_cpo/rewards/sandbox.py``); "OS" holds even for code past the audit hook:

- infinite loop / sleep: OS, ``RLIMIT_CPU`` and the wall timeout that SIGKILLs the child's process group.
- memory bomb: OS, ``RLIMIT_AS``.
- fork bomb, subprocesses: the audit hook (os.fork, subprocess, ...). ``RLIMIT_NPROC`` is also set but the kernel
  does not apply it to root, which is how this machine runs the tests, so it is not what these tests exercise.
- writing or deleting outside the working directory: the audit hook (as root, file permissions would not stop it).
- sockets: the audit hook, and (tested alone below) an empty network namespace where the kernel allows one.
- stdout flood: OS, ``RLIMIT_FSIZE`` on the files that stdout and stderr are redirected to.
- the parent's secrets: OS, a cleared environment; the audit hook refuses ``/proc/<pid>/environ`` and other files
  outside the working directory and the standard library.
- stray processes: every test checks that no sandboxed interpreter outlives its run (``no_stray_processes``).
"""
import functools
import os
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from megatron_cpo.rewards.sandbox import SandboxLimits, _child_setup, network_namespace_mode, run_python

FAST = SandboxLimits(wall_timeout_s=2.0, cpu_time_s=1, memory_mb=256, output_limit_bytes=64 * 1024)
GUARD_MARKER = "_DENIED_PREFIXES"  # appears in the command line of every sandboxed interpreter


def sandbox_processes():
    found = []
    for process in psutil.process_iter(["cmdline"]):
        if GUARD_MARKER in " ".join(process.info["cmdline"] or []):
            found.append(process.pid)
    return found


@pytest.fixture(autouse=True)
def no_stray_processes():
    yield
    deadline = time.monotonic() + 2
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == [], "a sandboxed process outlived its run"


def test_well_behaved_program_runs():
    result = run_python("a, b = map(int, input().split())\nprint(a + b)", "2 40\n", limits=FAST)
    assert (result.status, result.stdout.strip()) == ("ok", "42")


def test_call_mode_returns_json():
    result = run_python("class Solution:\n    def add(self, a, b):\n        return [a + b]", "[1, 2]",
                        limits=FAST, mode="call", fn_name="add")
    assert (result.status, result.stdout) == ("ok", "[3]")


def test_infinite_loop_is_killed_by_cpu_or_wall_limit():
    started = time.monotonic()
    result = run_python("while True:\n    pass", limits=FAST)
    assert result.status in ("cpu_limit", "timeout")
    assert time.monotonic() - started < FAST.wall_timeout_s + 10


def test_sleeping_program_is_killed_at_wall_timeout():
    result = run_python("import time\ntime.sleep(60)", limits=SandboxLimits(wall_timeout_s=0.5, cpu_time_s=1))
    assert result.status == "timeout" and result.wall_s < 10


def test_memory_bomb_hits_rlimit_as():
    result = run_python("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))", limits=FAST)
    assert result.status == "memory_limit"


def test_fork_bomb_is_refused_by_audit_hook():
    result = run_python("import os\nwhile True:\n    os.fork()", limits=FAST)
    assert result.status == "runtime_error" and "os.fork is not allowed" in result.stderr
    result = run_python("import subprocess\nsubprocess.Popen(['sleep', '60'])", limits=FAST)
    assert result.status == "runtime_error" and "not allowed" in result.stderr


def test_writing_outside_the_working_directory_is_refused(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    escaped = tmp_path / "escaped.txt"
    program = (f"import os\ntry:\n    open({str(escaped)!r}, 'w').write('x')\nexcept PermissionError as e:\n"
               f"    print('blocked', e)\nos.remove({str(victim)!r})")
    result = run_python(program, limits=FAST)
    assert result.status == "runtime_error" and "blocked" in result.stdout
    assert not escaped.exists() and victim.read_text() == "keep me"
    inside = run_python("open('scratch.txt', 'w').write('ok')\nprint(open('scratch.txt').read())", limits=FAST)
    assert (inside.status, inside.stdout.strip()) == ("ok", "ok")


@pytest.fixture
def loopback_listener():
    """A real TCP listener on loopback that records whether anyone connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    connections = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(server.accept())
            except (TimeoutError, OSError):
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield server.getsockname()[1], connections
    stop.set()
    thread.join()
    server.close()


def test_socket_to_parent_listener_is_refused(loopback_listener):
    port, connections = loopback_listener
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    result = run_python(program, limits=FAST)
    assert result.status == "runtime_error" and "connected" not in result.stdout
    result = run_python("import ctypes\nprint(ctypes.CDLL(None).socket(2, 1, 0))", limits=FAST)
    assert result.status == "runtime_error" and "ctypes" in result.stderr
    time.sleep(0.3)
    assert connections == []


def test_network_namespace_blocks_sockets_without_the_audit_hook(loopback_listener):
    """The OS layer alone (no audit hook): a plain interpreter in the child's network namespace cannot connect."""
    if network_namespace_mode() != "namespace":
        pytest.skip("this kernel refuses network namespaces to this user; only the audit hook blocks sockets here")
    port, connections = loopback_listener
    program = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')"
    child = subprocess.run([sys.executable, "-I", "-S", "-c", program], capture_output=True, text=True, timeout=20,
                           preexec_fn=functools.partial(_child_setup, FAST, True))
    assert child.returncode != 0 and "connected" not in child.stdout
    assert "Network is unreachable" in child.stderr or "Connection refused" in child.stderr
    assert connections == []


def test_reading_files_outside_the_sandbox_is_refused(tmp_path):
    secret = tmp_path / "credentials.txt"
    secret.write_text("token-do-not-leak")
    result = run_python(f"import fractions, json\nprint(open({str(secret)!r}).read())", limits=FAST)
    assert result.status == "runtime_error" and "token-do-not-leak" not in result.stdout + result.stderr
    assert "not allowed" in result.stderr


def test_stdout_flood_is_capped():
    result = run_python("while True:\n    print('x' * 1000)", limits=FAST)
    assert result.status == "output_limit"
    assert len(result.stdout) <= FAST.output_limit_bytes


def test_parent_environment_secrets_are_not_visible(monkeypatch):
    monkeypatch.setenv("MCPO_TEST_SECRET", "hunter2-do-not-leak")
    program = ("import os\nprint(dict(os.environ))\n"
               "for pid in (os.getppid(), 1):\n"
               "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
               "    except OSError as e:\n        print('blocked', e)")
    result = run_python(program, limits=FAST)
    assert "hunter2" not in result.stdout + result.stderr
    assert result.stdout.count("blocked") == 2


def test_parent_survives_a_run_of_hostile_programs():
    for program in ("while True: pass", "import os; os.kill(os.getpid(), 9)", "raise SystemExit(3)"):
        run_python(program, limits=SandboxLimits(wall_timeout_s=1.0, cpu_time_s=1))
    assert run_python("print('still fine')", limits=FAST).stdout.strip() == "still fine"
    assert os.getpid() == psutil.Process().pid


def test_limits_are_validated():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="mode"):
        run_python("print(1)", mode="call")
