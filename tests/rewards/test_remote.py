"""Remote reward model client against real HTTP servers on loopback: healthy, flaky, stalling, malformed."""
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from megatron_cpo.rewards import RemoteRewardConfig, RemoteRewardError, RemoteRewardModel, RewardServer


def length_scores(items):
    """A stand-in reward model: longer responses score higher (the protocol, not the model, is under test)."""
    return [len(item["response"]) / 10 for item in items]


def test_batched_scores_come_back_in_order():
    calls = []

    def recording(items):
        calls.append(len(items))
        return length_scores(items)

    with RewardServer(recording) as server:
        client = RemoteRewardModel(RemoteRewardConfig(url=server.url, batch_size=3, max_concurrent=2))
        responses = ["a" * n for n in range(8)]
        scores = client.score(["p"] * 8, responses)
    assert torch.allclose(scores, torch.arange(8, dtype=torch.float32) / 10)
    assert sorted(calls) == [2, 3, 3]


def test_reference_server_grades_verifiable_items():
    with RewardServer() as server:
        client = RemoteRewardModel(RemoteRewardConfig(url=server.url))
        extra = [{"data_source": "megatron_cpo/arith", "ground_truth": "4"}] * 2
        scores = client.score(["2+2?", "2+2?"], ["\\boxed{4}", "\\boxed{5}"], extra)
        assert scores.tolist() == [1.0, -1.0]
        with pytest.raises(RemoteRewardError, match="HTTP 400.*ground_truth"):
            client.score(["p"], ["r"])


def test_transient_server_errors_are_retried():
    failures_left = [2]

    def flaky(items):
        if failures_left[0] > 0:
            failures_left[0] -= 1
            raise RuntimeError("warming up")
        return length_scores(items)

    with RewardServer(flaky) as server:
        client = RemoteRewardModel(RemoteRewardConfig(url=server.url, max_retries=3, backoff_s=0.05))
        assert client.score(["p"], ["abc"]).tolist() == pytest.approx([0.3])
    assert failures_left == [0]


def test_stalling_server_times_out_and_fails_after_the_last_retry():
    def stalls(items):
        time.sleep(3)
        return length_scores(items)

    with RewardServer(stalls) as server:
        client = RemoteRewardModel(RemoteRewardConfig(url=server.url, timeout_s=0.3, max_retries=1, backoff_s=0.05))
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="failed 2 attempts.*timed out"):
            client.score(["p"], ["r"])
        assert time.monotonic() - started < 5


class _MalformedHandler(BaseHTTPRequestHandler):
    requests_seen = 0

    def log_message(self, *args):
        """Quiet."""

    def do_POST(self):  # noqa: N802
        type(self).requests_seen += 1
        self.rfile.read(int(self.headers["Content-Length"]))
        body = b'{"scores": [1.0, oops'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_malformed_json_is_retried_then_reported():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _MalformedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        client = RemoteRewardModel(RemoteRewardConfig(url=url, max_retries=2, backoff_s=0.01))
        with pytest.raises(RemoteRewardError, match="malformed answer"):
            client.score(["p"], ["r"])
        assert _MalformedHandler.requests_seen == 3
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_wrong_number_of_scores_and_client_errors():
    with RewardServer(lambda items: [1.0]) as server:
        client = RemoteRewardModel(RemoteRewardConfig(url=server.url, max_retries=0))
        with pytest.raises(RemoteRewardError, match="expected 2 scores"):
            client.score(["p", "q"], ["r", "s"])
        bad_path = RemoteRewardModel(RemoteRewardConfig(url=server.url + "/nope", max_retries=3, backoff_s=5))
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match="HTTP 404"):
            bad_path.score(["p"], ["r"])
        assert time.monotonic() - started < 4


def test_unreachable_server_and_config_validation():
    with pytest.raises(ValueError, match="reward.remote.url='localhost:8000' must start with http"):
        RemoteRewardConfig(enable=True, url="localhost:8000")
    with pytest.raises(ValueError, match="reward.remote.combine='mul'"):
        RemoteRewardConfig(combine="mul")
    with RewardServer(length_scores) as server:
        url = server.url
    client = RemoteRewardModel(RemoteRewardConfig(url=url, max_retries=1, backoff_s=0.01, timeout_s=1))
    with pytest.raises(RemoteRewardError, match="failed 2 attempts"):
        client.score(["p"], ["r"])
