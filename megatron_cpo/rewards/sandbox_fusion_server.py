"""A server for SandboxFusion's ``POST /run_code`` API (python) with this project's sandbox behind it: the tests run
the client against it, and it serves a grading fleet without a SandboxFusion deployment (docs/sandbox.md):

    python -m megatron_cpo.rewards.sandbox_fusion_server --host 0.0.0.0 --port 8080 [--backend namespaces|process]
"""
from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_cpo.rewards.sandbox import run_python
from megatron_cpo.rewards.sandbox_types import SandboxLimits, SandboxResult


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
