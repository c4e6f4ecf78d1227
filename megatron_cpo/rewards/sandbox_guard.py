"""The in-process half of the code sandbox: a CPython audit hook installed before the candidate program runs.

This file is passed verbatim to ``python -I -S -c`` and must only use the standard library. Its usage is
``-c <this source> <mode> <program> [fn_name]`` with mode ``stdio`` (run the program as ``__main__``) or ``call``
(load the program, call ``fn_name`` (a top-level function or a ``Solution`` method) with the JSON argument list read
from stdin, and print the JSON result).

The hook refuses, with ``PermissionError``: creating sockets, loading native code through ctypes, creating
processes (fork, exec, spawn, system, subprocess), writing, creating or removing anything outside the working
directory, and reading files other than the working directory, the Python standard library, ``/dev/{null,zero,
urandom}`` and ``/proc/self`` (so no other process's ``/proc/<pid>/environ``, where the parent's secrets live). It is a second
layer: the operating-system limits set by ``sandbox.py`` (rlimits, process group, network namespace) hold even for
code that gets past it.
"""
import json
import os
import sys

_WORKDIR = os.path.realpath(os.getcwd())
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATH_EVENTS = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink", "os.link",
                "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "os.chdir", "os.chroot"}
_DENIED_PREFIXES = ("socket.", "ctypes.", "os.fork", "os.exec", "os.spawn", "os.posix_spawn", "os.system",
                    "subprocess.", "os.kill", "os.killpg", "signal.pthread_kill", "_posixsubprocess", "pty.")
_READABLE_ROOTS = tuple({_WORKDIR, os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), "/dev/null",
                         "/dev/zero", "/dev/urandom", "/proc/self", "/proc/thread-self", "/usr/share/zoneinfo"})
_in_hook = [False]


def _inside_workdir(path):
    if isinstance(path, int):
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    resolved = os.path.realpath(os.path.join(_WORKDIR, path))
    return resolved == _WORKDIR or resolved.startswith(_WORKDIR + os.sep)


def _readable(path):
    if isinstance(path, int) or path is None:
        return True
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    resolved = os.path.realpath(os.path.join(_WORKDIR, path))
    return any(resolved == root or resolved.startswith(root + os.sep) for root in _READABLE_ROOTS)


def _guard(event, args):
    if _in_hook[0]:
        return
    _in_hook[0] = True
    try:
        if event.startswith(_DENIED_PREFIXES):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "open":
            path, mode, flags = args
            writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (flags or 0) & _WRITE_FLAGS
            if writes and not _inside_workdir(path):
                raise PermissionError(f"sandbox: writing {path!r} outside the working directory is not allowed")
            if not _readable(path):
                raise PermissionError(f"sandbox: reading {path!r} outside the working directory and the Python "
                                      "standard library is not allowed")
        elif event in _PATH_EVENTS:
            for path in args[:2]:
                if isinstance(path, (str, bytes)) and not _inside_workdir(path):
                    raise PermissionError(f"sandbox: {event} on {path!r} outside the working directory")
    finally:
        _in_hook[0] = False


def _run(mode, program_path, fn_name):
    with open(program_path, encoding="utf-8") as handle:
        code = compile(handle.read(), "solution.py", "exec")
    call_arguments = json.loads(sys.stdin.read()) if mode == "call" else None
    namespace = {"__name__": "__main__" if mode == "stdio" else "solution", "__builtins__": __builtins__}
    sys.argv = ["solution.py"]
    sys.addaudithook(_guard)
    exec(code, namespace)
    if mode == "call":
        target = namespace.get(fn_name)
        if target is None and "Solution" in namespace:
            target = getattr(namespace["Solution"](), fn_name, None)
        if target is None:
            raise NameError(f"function {fn_name!r} is not defined by the solution")
        result = target(*call_arguments)
        sys.stdout.write(json.dumps(result, default=list))


if __name__ == "__main__":
    _run(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
