"""SandboxFusion client: the ``remote`` backend of the code sandbox (``reward.sandbox.mode=remote``).

Speaks SandboxFusion's ``POST /run_code`` as verl does; 504s are retried, a service error raises
``RemoteSandboxError`` (the sample fails, never scored as wrong). Call-mode programs carry our harness.
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

from megatron_cpo.rewards.sandbox_runner import embedded_program
from megatron_cpo.rewards.sandbox_types import RUNNER_SOURCE, SandboxConfig, SandboxLimits, SandboxResult, classify

_RETRIES_ON_504 = 3
_REQUEST_SLACK_S = 30.0


class RemoteSandboxError(RuntimeError):
    """The remote sandbox did not run the program (unreachable, HTTP error, SandboxError)."""


def _post(url: str, payload: dict, timeout_s: float) -> dict:
    body = json.dumps(payload).encode()
    for attempt in range(_RETRIES_ON_504):
        request = urllib.request.Request(url, data=body, method="POST", headers={
            "Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as error:
            if error.code != 504 or attempt == _RETRIES_ON_504 - 1:
                raise RemoteSandboxError(f"sandbox_fusion {url} answered HTTP {error.code}: {error.reason}") from error
            time.sleep(0.5 * (attempt + 1))
        except (urllib.error.URLError, OSError, json.JSONDecodeError) as error:
            raise RemoteSandboxError(f"sandbox_fusion {url} unreachable or malformed answer ({error}); check "
                                     "reward.sandbox.fusion_url") from error
    raise AssertionError("unreachable")


def run_remote(program: str, stdin: str, limits: SandboxLimits, mode: str, fn_name: str | None,
               settings: SandboxConfig) -> SandboxResult:
    """Run one program on the SandboxFusion service at ``settings.fusion_url``."""
    code = program if mode == "stdio" else embedded_program(RUNNER_SOURCE, mode, program, fn_name)
    payload = {"code": code, "stdin": stdin, "language": "python", "compile_timeout": 10,
               "run_timeout": limits.wall_timeout_s, "memory_limit_MB": settings.fusion_memory_limit_mb,
               "files": {}, "fetch_files": []}
    started = time.monotonic()
    answer = _post(settings.fusion_url, payload, limits.wall_timeout_s + _REQUEST_SLACK_S)
    run = answer.get("run_result") or {}
    if answer.get("status") == "SandboxError" or run.get("status") == "Error" or not run:
        raise RemoteSandboxError(f"sandbox_fusion could not run the program: {answer.get('message') or answer}"[:500])
    stdout, stderr = run.get("stdout") or "", run.get("stderr") or ""
    returncode = run.get("return_code")
    status = classify(returncode, run.get("status") == "TimeLimitExceeded", stderr,
                      len(stdout.encode()) >= limits.output_limit_bytes)
    return SandboxResult(status, returncode, stdout, stderr, time.monotonic() - started)
