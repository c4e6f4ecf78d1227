"""SandboxFusion client (``reward.sandbox.mode=remote``) and a loopback server with our own sandbox behind it.

The client speaks SandboxFusion's ``POST /run_code`` API the way verl does (``reward_model.sandbox_fusion.url``,
``max_concurrent``, ``memory_limit_mb``; the URL is the full endpoint, e.g. ``http://host:8080/run_code``): a JSON
request ``{code, stdin, language: "python", run_timeout, compile_timeout, memory_limit_MB, files, fetch_files}``
and a response ``{status: Success|Failed|SandboxError, message, run_result: {status: Finished|TimeLimitExceeded|
Error, return_code, stdout, stderr, execution_time}}``. Gateway timeouts (504) are retried; a ``SandboxError`` or an
unreachable service raises ``RemoteSandboxError`` (the sample fails and is counted in ``reward/errors``; it is never
scored as a wrong answer). Call-mode programs are sent as one source file with our harness
(``sandbox_runner.embedded_program``).

``FusionCompatibleServer`` implements that endpoint with ``run_python`` (namespaces or process backend) behind it:
the tests run the client against it, and a user without a SandboxFusion deployment can serve a grading fleet with it.
"""
from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_cpo.rewards.sandbox import (
    RUNNER_SOURCE,
    SandboxLimits,
    SandboxResult,
    SandboxConfig,
    classify,
    run_python,
)
from megatron_cpo.rewards.sandbox_runner import embedded_program

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


def _response(result: SandboxResult) -> dict:
    """SandboxFusion's RunCodeResponse for one of our runs."""
    finished = result.status != "timeout"
    return {"status": "Success" if result.status == "ok" else "Failed", "message": "", "compile_result": None,
            "run_result": {"status": "Finished" if finished else "TimeLimitExceeded", "execution_time": result.wall_s,
                           "return_code": result.returncode, "stdout": result.stdout, "stderr": result.stderr},
            "executor_pod_name": None, "files": {}}


class _RunCodeHandler(BaseHTTPRequestHandler):
    server: FusionCompatibleServer

    def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
        if self.path.rstrip("/") != "/run_code":
            self._reply(404, {"detail": f"no endpoint {self.path}; POST /run_code"})
            return
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            if request.get("language") != "python":
                raise ValueError(f"language {request.get('language')!r} is not served here; only 'python'")
            memory_mb = int(request.get("memory_limit_MB", -1))
            limits = SandboxLimits(wall_timeout_s=float(request.get("run_timeout", 10)),
                                   cpu_time_s=max(1, int(float(request.get("run_timeout", 10)))),
                                   memory_mb=memory_mb if memory_mb > 0 else self.server.default_memory_mb,
                                   python_executable=self.server.python_executable)
            result = run_python(request["code"], request.get("stdin") or "", limits=limits,
                                backend=self.server.backend)
            self._reply(200, _response(result))
        except Exception as error:  # the service reports its own failures as SandboxError, as SandboxFusion does
            self._reply(200, {"status": "SandboxError", "message": f"{type(error).__name__}: {error}"[:500],
                              "compile_result": None, "run_result": None, "executor_pod_name": None, "files": {}})

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


class FusionCompatibleServer(ThreadingHTTPServer):
    """``POST /run_code`` on ``host:port`` (0: any free port), each request run by ``run_python`` with ``backend``.
    ``url`` is the endpoint for ``reward.sandbox.fusion_url``; ``start``/``close`` run it on a daemon thread."""

    daemon_threads = True

    def __init__(self, host: str = "127.0.0.1", port: int = 0, backend: str = "namespaces",
                 default_memory_mb: int = 512, python_executable: str | None = None) -> None:
        super().__init__((host, port), _RunCodeHandler)
        self.backend, self.default_memory_mb = backend, default_memory_mb
        self.python_executable = python_executable or SandboxLimits().python_executable
        self._thread = threading.Thread(target=self.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}/run_code"

    def start(self) -> FusionCompatibleServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join()


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Serve SandboxFusion's POST /run_code (python) with our sandbox.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--backend", default="namespaces", choices=("namespaces", "process"))
    options = parser.parse_args()
    server = FusionCompatibleServer(options.host, options.port, options.backend)
    print(f"serving {server.url} with the {options.backend} sandbox", flush=True)
    server.serve_forever()
