"""The harness that runs the candidate program inside the sandbox; not a security layer (it guards nothing).

Passed to ``python -I -S -B -c`` (standard library only) as ``<this source> <mode> <program> [fn_name]``: ``stdio``
runs the program as ``__main__``, ``call`` calls ``fn_name`` (a function or ``Solution`` method) on the JSON
arguments from stdin and prints the JSON result. ``embedded_program`` makes one file for a remote sandbox.
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
