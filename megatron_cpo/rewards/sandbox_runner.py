"""The harness that runs the candidate program inside the sandbox. It is not a security layer: it holds no secrets
and guards nothing; the isolation is the operating system's (``sandbox_launcher.py``) or the remote service's.

Passed verbatim to ``python -I -S -B -c`` and standard library only. Usage: ``-c <this source> <mode> <program>
[fn_name]`` with mode ``stdio`` (run the program as ``__main__``) or ``call`` (load the program, call ``fn_name``, a
top-level function or a ``Solution`` method, with the JSON argument list read from stdin, and print the JSON
result). For a remote sandbox, which runs one source file, ``embedded_program`` appends the program and the call.
"""
import json
import sys


def run(mode, source, fn_name):
    code = compile(source, "solution.py", "exec")
    call_arguments = json.loads(sys.stdin.read()) if mode == "call" else None
    namespace = {"__name__": "__main__" if mode == "stdio" else "solution", "__builtins__": __builtins__}
    sys.argv = ["solution.py"]
    exec(code, namespace)
    if mode == "call":
        target = namespace.get(fn_name)
        if target is None and "Solution" in namespace:
            target = getattr(namespace["Solution"](), fn_name, None)
        if target is None:
            raise NameError(f"function {fn_name!r} is not defined by the solution")
        result = target(*call_arguments)
        sys.stdout.write(json.dumps(result, default=list))


def embedded_program(runner_source, mode, program, fn_name):
    """One self-contained source file: this harness, then the call that runs ``program`` in ``mode``."""
    return f"{runner_source}\nrun({mode!r}, {program!r}, {fn_name!r})\n"


if __name__ == "__main__" and len(sys.argv) > 2:  # not when embedded in a remote source file
    with open(sys.argv[2], encoding="utf-8") as handle:
        run(sys.argv[1], handle.read(), sys.argv[3] if len(sys.argv) > 3 else None)
