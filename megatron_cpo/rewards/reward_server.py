"""A small reference reward server (stdlib ``http.server``) that ``RemoteRewardModel`` talks to.

``POST /score`` answers ``{"scores": [...]}``; a real model plugs in as ``score_fn(items) -> list[float]``, the
default grades with ``compute_score``. Protocol and use: docs/data.md, "A remote reward model".
"""
from __future__ import annotations

import argparse
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards.registry import compute_score

ScoreFn = Callable[[list[dict]], list[float]]
MAX_REQUEST_BYTES = 64 << 20


def verifiable_scores(items: list[dict]) -> list[float]:
    """Score each item with the registered grader of its ``data_source`` against its ``ground_truth``."""
    for position, item in enumerate(items):
        if "data_source" not in item or "ground_truth" not in item:
            raise ValueError(f"item {position} lacks 'data_source' or 'ground_truth', which the verifiable scorer "
                             "needs; start the server with a reward-model scorer for plain (prompt, response) items")
    return [compute_score(item["data_source"], item["response"], item["ground_truth"], item.get("extra_info"))["score"]
            for item in items]


class _Handler(BaseHTTPRequestHandler):
    server: _RewardHTTPServer

    def log_message(self, format: str, *args: object) -> None:
        """Silence per-request logging; training logs have better uses."""

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            return  # the client gave up (its timeout); nothing left to answer

    def do_GET(self) -> None:  # noqa: N802 (http.server naming)
        if self.path == "/health":
            self._reply(200, {"status": "ok"})
        else:
            self._reply(404, {"error": f"unknown path {self.path!r}; use POST /score or GET /health"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/score":
            self._reply(404, {"error": f"unknown path {self.path!r}; use POST /score"})
            return
        length = int(self.headers.get("Content-Length", 0))
        if length <= 0 or length > MAX_REQUEST_BYTES:
            self._reply(400, {"error": f"Content-Length {length} must be in (0, {MAX_REQUEST_BYTES}]"})
            return
        try:
            request = json.loads(self.rfile.read(length))
            items = request["items"]
            if not isinstance(items, list) or not all(isinstance(item, dict) and "response" in item
                                                      for item in items):
                raise ValueError("'items' must be a list of objects with a 'response'")
        except (ValueError, KeyError, TypeError) as error:
            self._reply(400, {"error": f"bad request: {error}"})
            return
        try:
            scores = [float(score) for score in self.server.score_fn(items)]
        except ValueError as error:
            self._reply(400, {"error": f"items rejected by the scorer: {error}"})
            return
        except Exception as error:  # a scorer failure is reported to the client, which may retry
            self._reply(500, {"error": f"scorer failed: {type(error).__name__}: {error}"})
            return
        self._reply(200, {"scores": scores})


class _RewardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], score_fn: ScoreFn) -> None:
        super().__init__(address, _Handler)
        self.score_fn = score_fn


class RewardServer:
    """Serve ``score_fn`` on ``host:port`` (port 0 picks a free one) from a background thread."""

    def __init__(self, score_fn: ScoreFn = verifiable_scores, host: str = "127.0.0.1", port: int = 0) -> None:
        self._httpd = _RewardHTTPServer((host, port), score_fn)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="reward-server", daemon=True)

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:40123``."""
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> RewardServer:
        """Start serving in the background; returns self."""
        self._thread.start()
        return self

    def wait(self) -> None:
        """Block while serving (the command-line entry's foreground)."""
        self._thread.join()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def __enter__(self) -> RewardServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def main() -> None:
    """Command-line entry: serve until interrupted."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--scorer", default=None, help="pkg.module:fn taking a list of items, returning scores")
    arguments = parser.parse_args()
    score_fn = import_callable(arguments.scorer, "--scorer") if arguments.scorer else verifiable_scores
    server = RewardServer(score_fn, arguments.host, arguments.port).start()
    print(f"reward server on {server.url}", flush=True)
    try:
        server.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
