"""Why a run stopped before its end, as one line that says what to do (the CLI prints it instead of a traceback)."""
from __future__ import annotations


class RunAbortedError(RuntimeError):
    """The run stopped early and cannot go on by itself; `exit_code` is the process status the CLI exits with."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code
