"""The trusted half of the namespace sandbox: builds the jail, starts the untrusted program in it, tears it down.

Runs as a small stdlib-only server per grading process that forks one launcher per program; launcher, PID-1 init
and program are described in docs/sandbox.md, "How the jail is built".
"""
from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import socket
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x04000000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MNT_DETACH = 0x2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_NO_NEW_PRIVS, SECCOMP_MODE_FILTER = 1, 22, 38, 2
# per machine: audit arch, and the numbers of pivot_root, unshare, clone, clone3
SYSCALLS = {"x86_64": (0xC000003E, 155, 272, 56, 435), "aarch64": (0xC00000B7, 41, 97, 220, 435)}
DEVICES = ("null", "zero", "random", "urandom")
libc = ctypes.CDLL(None, use_errno=True)


def _syscalls() -> tuple[int, int, int, int, int]:
    machine = os.uname().machine
    if machine not in SYSCALLS:
        raise OSError(f"sandbox launcher: machine {machine!r} is not supported (only {', '.join(SYSCALLS)})")
    return SYSCALLS[machine]


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _deny_new_user_namespaces() -> None:
    """A seccomp filter: ``unshare``/``clone`` with ``CLONE_NEWUSER`` fail with EPERM (a user namespace would give
    the program capabilities over new namespaces: kernel attack surface it has no use for), ``clone3`` with ENOSYS
    (its flags cannot be inspected; the C library falls back to ``clone``), the x32 ABI with EPERM, any other
    architecture's syscalls kill the process. Everything else is allowed."""
    arch, _, unshare, clone, clone3 = _syscalls()
    load, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys, kill = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38, 0x80000000
    program = [(load, 0, 0, 4), (jeq, 0, 10, arch), (load, 0, 0, 0), (jge, 6, 0, 0x40000000), (jeq, 6, 0, clone3),
               (jeq, 1, 0, unshare), (jeq, 0, 2, clone), (load, 0, 0, 16), (jset, 1, 0, CLONE_NEWUSER),
               (ret, 0, 0, allow), (ret, 0, 0, eperm), (ret, 0, 0, enosys), (ret, 0, 0, kill)]
    filters = (_SockFilter * len(program))(*[_SockFilter(*instruction) for instruction in program])
    fprog = _SockFprog(len(program), filters)
    _check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp filter")


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"sandbox launcher: {what}: {os.strerror(error)}")


def _encode(text: str | None) -> bytes | None:
    return text.encode() if text is not None else None


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(libc.mount(_encode(source), _encode(target), _encode(fstype), ctypes.c_ulong(flags), _encode(data)),
           f"mount {source} on {target}")


def _make_dirs(path: str) -> None:
    """Like ``os.makedirs``, but every created level is 0711: traversable, not listable (``/root`` shows nothing)."""
    if not os.path.isdir(path):
        _make_dirs(os.path.dirname(path))
        os.mkdir(path, 0o711)


def _bind_read_only(source: str, target: str) -> None:
    if os.path.isdir(source):
        _make_dirs(target)
    else:
        _make_dirs(os.path.dirname(target))
        open(target, "a").close()
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_root(settings: dict) -> None:
    """Make the private root described in the module docstring and ``pivot_root`` into it."""
    root, uid = settings["root_dir"], settings["uid"]
    os.umask(0o022)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("sandbox-root", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=0755")
    for name in ("bin", "lib", "lib64", "lib32", "sbin"):
        if os.path.islink("/" + name):
            os.symlink(os.readlink("/" + name), os.path.join(root, name))
        elif os.path.isdir("/" + name):
            _bind_read_only("/" + name, os.path.join(root, name))
    for path in settings["read_only_paths"]:
        _bind_read_only(path, root + path)
    os.makedirs(root + "/dev", mode=0o755)
    _mount("sandbox-dev", root + "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=0755")
    for device in DEVICES:
        open(f"{root}/dev/{device}", "a").close()
        _mount(f"/dev/{device}", f"{root}/dev/{device}", None, MS_BIND)
    os.makedirs(root + "/proc", mode=0o555)
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    os.makedirs(root + "/work")
    _mount("sandbox-work", root + "/work", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={settings['work_dir_mb']}m,mode=0700,uid={uid},gid={uid}")
    with open(settings["program_path"], "rb") as source, open(root + "/work/solution.py", "wb") as target:
        target.write(source.read())
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    os.chdir(root)
    _check(libc.syscall(_syscalls()[1], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "detach the old root")
    os.chdir("/")


def _exec_program(settings: dict) -> None:
    """In the forked program process: drop everything, then become the interpreter running the candidate."""
    os.closerange(3, 1 << 16)
    uid, limits = settings["uid"], settings["rlimits"]
    for name, value in limits.items():
        resource.setrlimit(getattr(resource, name), (value, value if name != "RLIMIT_CPU" else value + 1))
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    os.chdir("/work")
    _deny_new_user_namespaces()
    os.execve(settings["argv"][0], settings["argv"], {})


def _init(settings: dict, status_fd: int) -> int:
    """PID 1 of the sandbox: build the root, run the program, report how it ended."""
    _check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "parent-death signal")
    _build_root(settings)
    _check(libc.sethostname(b"sandbox", 7), "sethostname")
    program = os.fork()
    if program == 0:
        try:
            os.close(status_fd)
            _exec_program(settings)
        finally:
            os._exit(126)
    while True:  # reap everything re-parented to us until the program itself has ended
        pid, status = os.waitpid(-1, 0)
        if pid == program:
            break
    report = f"signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"exit {os.WEXITSTATUS(status)}"
    os.write(status_fd, report.encode() + b"\n")
    return 0


def launch(settings: dict) -> int:
    """The launcher's part (see the module docstring); returns its exit code."""
    settings = dict(settings, uid=settings["uid_base"] + os.getpid())  # unique among live sandboxes, owns nothing
    status_fd = settings["status_fd"]
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the server's reaper is not ours: we wait for the init
    os.write(status_fd, f"launcher {os.getpid()}\n".encode())
    try:
        _check(libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | CLONE_NEWNET), "unshare")
        init = os.fork()
    except OSError as error:
        os.write(status_fd, f"error {error}\n".encode())
        return 1
    if init == 0:
        try:
            code = _init(settings, status_fd)
        except BaseException as error:  # the jail could not be built: report it, never run the program outside
            os.write(status_fd, f"error {type(error).__name__}: {error}\n".encode())
            code = 1
        os._exit(code)
    pidfd = os.pidfd_open(init)
    if not select.select([pidfd], [], [], settings["wall_timeout_s"])[0]:
        os.kill(init, signal.SIGKILL)
        os.write(status_fd, b"timeout\n")
    os.waitpid(init, 0)  # returns once the init, and with it every process of the namespace, is gone
    return 0


def _reap(*_: object) -> None:
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass


def serve(connection: socket.socket) -> None:
    """Fork one launcher per request until the grading process closes its end of ``connection``."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGCHLD, _reap)  # launchers are reaped as they end (their CPU time shows as ours)
    while True:
        message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        if not message:
            return
        if os.fork() == 0:
            code = 1
            try:
                libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # a killed grading process ends its runs
                connection.close()
                moved = [os.dup(fd) for fd in fds]  # above every target number: no dup2 below clobbers a source
                for target, fd in enumerate(moved):
                    os.dup2(fd, target)
                os.closerange(len(fds), 1 << 16)
                os.setsid()
                code = launch(json.loads(message))
            finally:
                os._exit(code)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":
    serve(socket.socket(fileno=int(sys.argv[1])))
