"""Shared by the actor benchmarks of this folder: each setting in a fresh process, settings alternated over rounds.

`run_alternated` calls `SCRIPT --one NAME ...` once per setting and round (the order reversed every other round, so
that load changes hit all settings alike), reads the `RESULT {json}` line the child prints, adds the round and the
1-minute load average at its start, and appends it to a JSONL file. `cpu_seconds` is what the children time with:
user + system seconds of the process, which count the work and move less with the load than wall seconds.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from pathlib import Path


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def print_result(result: dict) -> None:
    """What a child prints for its parent: one `RESULT` line."""
    print("RESULT " + json.dumps(result), flush=True)


def run_alternated(script: str, settings: list[str], rounds: int, child_args: list[str], out: str | Path,
                   cwd: Path) -> None:
    """Run every setting `rounds` times, each in its own `python script --one NAME *child_args`; append results."""
    with open(out, "a") as file:
        for round_index in range(rounds):
            order = settings if round_index % 2 == 0 else list(reversed(settings))
            for name in order:
                load = os.getloadavg()[0]
                done = subprocess.run([sys.executable, script, "--one", name, *child_args], cwd=cwd,
                                      capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
                if done.returncode or not lines:
                    sys.exit(f"error: setting {name} failed:\n{done.stderr[-3000:]}")
                result = {**json.loads(lines[-1][7:]), "round": round_index, "load_1min_start": load}
                file.write(json.dumps(result) + "\n")
                file.flush()
                print(json.dumps({k: v for k, v in result.items() if k != "steps"}), flush=True)
