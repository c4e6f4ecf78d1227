"""Attacks on the code sandbox, each run in the namespace backend (the boundary) and shown contained.

Every program here runs with no Python-level guard at all; what stops it is the operating system
(``megatron_cpo/rewards/sandbox_launcher.py``): an unprivileged uid, PID/mount/IPC/UTS/network namespaces, a tmpfs
root with only ``/usr`` and the interpreter read-only, ``no_new_privs``, rlimits, PID-namespace teardown. After
every test no sandbox process is left (``no_stray_processes``): sandbox programs run as uids from
``SANDBOX_UID_BASE`` up, checked right after the call returns with no grace period ("no process outlives the call"
is meant literally); the trusted launchers, children of this process's launcher server, must end too.

The test process is root here (as on CI), which is what the namespace backend needs; where the kernel refuses
namespaces the tests of this file are skipped with the reason (the process backend's own tests are in
``test_sandbox_process.py``).
"""
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_cpo.rewards.sandbox import run_python
from megatron_cpo.rewards.sandbox_namespaces import launcher_server, namespaces_unavailable_reason
from megatron_cpo.rewards.sandbox_types import SandboxLimits

pytestmark = [pytest.mark.skipif(namespaces_unavailable_reason() is not None,
                                 reason=f"namespaces refused here: {namespaces_unavailable_reason()}"),
              pytest.mark.slow]  # programs run in jails, bombs run into their limits: seconds each
FAST = SandboxLimits(wall_timeout_s=5.0, cpu_time_s=1, memory_mb=256, output_limit_bytes=64 * 1024)
SANDBOX_UID_BASE = 1_000_000


def jailed(program: str, stdin: str = "", limits: SandboxLimits = FAST, **kwargs):
    return run_python(program, stdin, limits=limits, backend="namespaces", **kwargs)


def sandbox_processes() -> list[int]:
    """Live (non-zombie) processes running as a sandbox uid: the program and everything it started."""
    found = []
    for process in psutil.process_iter(["uids", "status"]):
        try:
            if process.info["status"] != psutil.STATUS_ZOMBIE and process.info["uids"].real >= SANDBOX_UID_BASE:
                found.append(process.pid)
        except (psutil.Error, AttributeError):
            continue
    return found


def launchers() -> list[int]:
    """Launchers and inits (the trusted side, root) still running: children of this process's launcher server."""
    server = launcher_server.pid()
    found = []
    for child in psutil.Process(server).children(recursive=True) if server else []:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                found.append(child.pid)
        except psutil.NoSuchProcess:
            continue
    return found


@pytest.fixture(autouse=True)
def no_stray_processes():
    """Right after the call, no sandbox process may be left; the launcher closes the status pipe while it exits,
    so it may still be finishing its own exit for a moment (it runs nothing of the program's)."""
    yield
    assert sandbox_processes() == [], "a sandboxed process outlived its call"
    deadline = time.monotonic() + 5
    while launchers() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert launchers() == [], "a launcher did not end after its run"


@pytest.fixture
def bystander():
    """An unrelated process the attacks aim at; it must survive them."""
    process = subprocess.Popen(["sleep", "120"])
    yield process
    assert process.poll() is None, "the unrelated process was killed from inside the sandbox"
    process.kill()
    process.wait()


def test_correct_and_wrong_programs_and_call_mode():
    assert jailed("a, b = map(int, input().split())\nprint(a + b)", "2 40\n").stdout == "42\n"
    assert jailed("print(int(input()) + 1)", "1\n").stdout.strip() == "2"
    result = jailed("class Solution:\n    def add(self, a, b):\n        return [a + b]", "[1, 2]", mode="call",
                    fn_name="add")
    assert (result.status, result.stdout) == ("ok", "[3]")
    assert jailed("raise ValueError('no')").status == "runtime_error"


def test_switching_off_the_old_audit_guard_gains_nothing():
    """The old guard kept its on/off state in a module flag the program could flip; there is no such layer now and
    the files it was meant to protect are simply not in the program's world."""
    program = ("import sys\nguard = sys.modules.get('__main__')\nflag = getattr(guard, '_in_hook', None)\n"
               "if flag is not None:\n    flag[0] = True\nprint(open('/etc/shadow').read())")
    result = jailed(program)
    assert result.status == "runtime_error" and "FileNotFoundError" in result.stderr
    with open("/etc/shadow") as shadow:  # the test runs as root: the host file is readable to it
        first_entry = shadow.readline().split(":")[0] + ":"
    assert first_entry not in result.stdout


def test_parent_environment_and_other_processes_are_out_of_reach(monkeypatch):
    monkeypatch.setenv("MCPO_TEST_SECRET", "hunter2-do-not-leak")
    program = ("import os\nprint(dict(os.environ))\n"
               f"for pid in (os.getppid(), 1, {os.getpid()}):\n"
               "    try:\n        print(open(f'/proc/{pid}/environ').read())\n"
               "    except OSError as e:\n        print('blocked', type(e).__name__)\n"
               "print(sorted(p for p in os.listdir('/proc') if p.isdigit()))")
    result = jailed(program)
    assert "hunter2" not in result.stdout + result.stderr
    assert result.stdout.count("blocked") == 3
    assert result.stdout.strip().splitlines()[-1] == "['2']", "the program must see only itself"  # pid 1 is hidden


def test_pidfd_and_kill_cannot_reach_the_caller_or_an_unrelated_process(bystander):
    targets = (os.getpid(), os.getppid(), bystander.pid)
    program = ("import os, signal\n"
               f"for pid in {targets}:\n"
               "    try:\n        fd = os.pidfd_open(pid)\n        signal.pidfd_send_signal(fd, signal.SIGKILL)\n"
               "        print('pidfd killed', pid)\n    except OSError as e:\n        print('pidfd', pid, e.errno)\n"
               "    try:\n        os.kill(pid, signal.SIGKILL)\n        print('killed', pid)\n"
               "    except OSError as e:\n        print('kill', pid, e.errno)\n"
               "try:\n    os.kill(-1, signal.SIGKILL)\nexcept OSError as e:\n    print('kill -1', e.errno)")
    result = jailed(program)
    assert "killed" not in result.stdout, result.stdout
    assert bystander.poll() is None and psutil.pid_exists(os.getppid())


def test_raw_libc_through_ctypes_is_contained(tmp_path, bystander):
    target = tmp_path / "written-by-libc.txt"
    program = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               f"print('kill', libc.kill({bystander.pid}, 9), libc.kill({os.getpid()}, 9))\n"
               f"fd = libc.open({str(target).encode()!r}, os.O_CREAT | os.O_WRONLY, 0o644)\n"
               "print('open', fd, ctypes.get_errno())\nprint('write', libc.write(fd, b'pwned', 5))\n"
               "print('socket', libc.socket(2, 1, 0))")
    result = jailed(program)
    assert result.status == "ok", result.stderr
    assert "kill -1 -1" in result.stdout and "open -1" in result.stdout and "write -1" in result.stdout
    assert not target.exists() and bystander.poll() is None


def test_nothing_can_be_created_outside_the_work_directory(tmp_path):
    marker = f"mcpo-escaped-{uuid.uuid4().hex}"  # unique: other jobs on this machine write to /tmp too
    outside = [tmp_path / "fifo", tmp_path / "escaped.txt", Path("/tmp") / f"{marker}.fifo",
               Path("/tmp") / f"{marker}.txt", Path("/usr") / marker, Path("/") / marker, Path("/dev/shm") / marker]
    attempts = [f"os.mkfifo({str(outside[0])!r})", f"open({str(outside[1])!r}, 'w')", f"os.mkfifo({str(outside[2])!r})",
                f"open({str(outside[3])!r}, 'w')", f"open({str(outside[4])!r}, 'w')", f"open({str(outside[5])!r}, 'w')",
                f"os.mkdir({str(outside[6])!r})"]
    program = "import os\n" + "".join(f"try:\n    {attempt}\n    print('made')\nexcept OSError as e:\n"
                                      f"    print('refused', e.errno)\n" for attempt in attempts)
    program += "os.mkfifo('inside.fifo')\nopen('inside.txt', 'w').write('ok')\nprint(sorted(os.listdir('.')))"
    result = jailed(program)
    assert result.status == "ok", result.stderr
    assert result.stdout.count("refused") == len(attempts) and "made" not in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "['inside.fifo', 'inside.txt', 'solution.py']"
    assert list(tmp_path.iterdir()) == [] and not any(path.exists() for path in outside)


def test_the_host_filesystem_is_hidden():
    program = ("import os\nprint(sorted(os.listdir('/')))\n"
               "for path in ('/root', '/etc', '/home', '/work/..'):\n"
               "    try:\n        print(path, os.listdir(path))\n"
               "    except OSError as e:\n        print(path, 'refused', e.errno)")
    lines = jailed(program).stdout.strip().splitlines()
    assert lines[0] == "['bin', 'dev', 'lib', 'lib64', 'proc', 'root', 'sbin', 'usr', 'work']"
    assert lines[1:4] == ["/root refused 13", "/etc refused 2", "/home refused 2"]


def test_new_user_namespaces_are_refused_but_threads_and_fork_work():
    """A user namespace would hand the program capabilities over fresh namespaces (kernel attack surface): the
    seccomp filter refuses CLONE_NEWUSER through unshare and clone, and clone3 (whose flags it cannot read)."""
    program = ("import ctypes, os, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
               "print(libc.unshare(0x10000000), ctypes.get_errno())\n"
               "print(libc.syscall(56 if os.uname().machine == 'x86_64' else 220, 0x10000000 | 17, 0, 0, 0, 0), "
               "ctypes.get_errno())\n"
               "print(libc.syscall(435, 0, 0), ctypes.get_errno())\n"
               "thread = threading.Thread(target=print, args=('thread',))\nthread.start()\nthread.join()\n"
               "child = os.fork()\nif child == 0:\n    os._exit(7)\nprint('fork', os.waitstatus_to_exitcode("
               "os.waitpid(child, 0)[1]))")
    result = jailed(program)
    assert result.stdout.splitlines() == ["-1 1", "-1 1", "-1 38", "thread", "fork 7"], result.stderr


def test_a_double_forked_setsid_daemon_does_not_outlive_the_call():
    program = ("import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
               "        time.sleep(60)\n    os._exit(0)\nprint('parent done')")
    result = jailed(program)
    assert (result.status, result.stdout.strip()) == ("ok", "parent done")
    # no_stray_processes checks, with no grace period, that the sleeping grandchild is gone


def test_fork_and_thread_bombs_are_capped_and_leave_nothing_behind():
    started = time.monotonic()
    fork_bomb = jailed("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert fork_bomb.status in ("timeout", "cpu_limit")
    assert sandbox_processes() == []
    threads = jailed("import threading, time\nn = 0\ntry:\n    while True:\n"
                     "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n        n += 1\n"
                     "except RuntimeError:\n    print(n)")
    assert threads.status == "ok" and int(threads.stdout) < FAST.max_processes
    assert time.monotonic() - started < 2 * FAST.wall_timeout_s + 10


def test_memory_output_and_cpu_bombs_hit_their_limits():
    assert jailed("blocks = []\nwhile True:\n    blocks.append(bytearray(32 << 20))").status == "memory_limit"
    flood = jailed("while True:\n    print('x' * 1000)")
    assert flood.status == "output_limit" and len(flood.stdout) <= FAST.output_limit_bytes
    assert jailed("while True:\n    pass").status in ("cpu_limit", "timeout")
    disk = jailed("open('big', 'wb').write(b'x' * (40 << 20))", limits=SandboxLimits(
        wall_timeout_s=3.0, cpu_time_s=2, output_limit_bytes=64 << 20, work_dir_mb=8))
    assert disk.status == "runtime_error" and "No space left" in disk.stderr


def test_sleeping_program_is_killed_at_wall_timeout():
    result = jailed("import time\ntime.sleep(60)", limits=SandboxLimits(wall_timeout_s=0.5, cpu_time_s=1))
    assert result.status == "timeout" and result.wall_s < 10


@pytest.fixture
def loopback_listener():
    """A real TCP listener on the host's loopback that records whether anyone connected."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.1)
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


def test_no_network_not_even_the_host_loopback(loopback_listener):
    port, connections = loopback_listener
    program = (f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
               "    print('connected')\nexcept OSError as e:\n    print('refused', e.errno)")
    result = jailed(program)
    assert result.stdout.strip() == "refused 101"  # ENETUNREACH: the namespace's loopback is down, no route
    probe = socket.create_connection(("127.0.0.1", port), timeout=5)  # the listener works for the host
    deadline = time.monotonic() + 5
    while not connections and time.monotonic() < deadline:
        time.sleep(0.01)
    probe.close()
    assert len(connections) == 1, "only the test's own probe connected"


def test_the_grader_survives_hostile_programs_and_keeps_grading():
    for program in ("while True: pass", "import os; os.kill(os.getpid(), 9)", "raise SystemExit(3)",
                    "import os, signal; os.kill(os.getppid(), signal.SIGKILL)"):
        jailed(program, limits=SandboxLimits(wall_timeout_s=1.0, cpu_time_s=1))
    assert jailed("print('still fine')").stdout.strip() == "still fine"


def test_limits_are_validated():
    with pytest.raises(ValueError, match="memory_mb"):
        SandboxLimits(memory_mb=8)
    with pytest.raises(ValueError, match="mode"):
        run_python("print(1)", mode="call")
    with pytest.raises(ValueError, match="backend"):
        run_python("print(1)", backend="chroot")


def test_killing_the_grading_process_ends_its_sandboxes():
    """The reward pool SIGKILLs a grading worker that overruns its budget: its launcher server, launchers, inits and
    programs must all go with it (parent-death signals down the chain, then the PID-namespace teardown)."""
    program = ("from megatron_cpo.rewards.sandbox import run_python, SandboxLimits\n"
               "run_python('import time\\ntime.sleep(120)', backend='namespaces', limits="
               "SandboxLimits(wall_timeout_s=120, cpu_time_s=60))")
    grader = subprocess.Popen([sys.executable, "-c", program],
                              env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    deadline = time.monotonic() + 30
    while not any(uid >= SANDBOX_UID_BASE for uid in sandbox_uids()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert any(uid >= SANDBOX_UID_BASE for uid in sandbox_uids()), "the sandboxed program never started"
    grader.kill()
    grader.wait()
    deadline = time.monotonic() + 10
    while sandbox_uids() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_uids() == []


def sandbox_uids() -> list[int]:
    uids = []
    for process in psutil.process_iter(["uids", "status"]):
        if process.info["uids"] and process.info["uids"].real >= SANDBOX_UID_BASE and \
                process.info["status"] != psutil.STATUS_ZOMBIE:
            uids.append(process.info["uids"].real)
    return uids
