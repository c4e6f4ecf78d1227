"""HTTP client for a remote reward model (the protocol of ``reward_server.py``).

Requests are batched (``batch_size`` items each, up to ``max_concurrent_requests`` in flight), each with a timeout.
Timeouts, connection errors, HTTP 429/5xx and malformed answers (bad JSON, wrong number of scores, non-numbers) are
retried with exponential backoff; after the last attempt a ``RemoteRewardError`` says what failed and where. Other
HTTP 4xx answers mean the request itself is wrong and fail at once.
"""
from __future__ import annotations

import json
import math
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch


class RemoteRewardError(RuntimeError):
    """The reward model could not score a batch."""


class _Retryable(Exception):
    pass


@dataclass
class RemoteRewardConfig:
    """Where the reward model is and how hard to try. ``url`` is the server's base URL (``/score`` is appended)."""

    url: str
    batch_size: int = 64
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_multiplier: float = 2.0
    max_concurrent_requests: int = 4

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward_model.url={self.url!r} must start with http:// or https://")
        if self.batch_size < 1 or self.max_concurrent_requests < 1:
            raise ValueError(f"reward_model.batch_size={self.batch_size} and max_concurrent_requests="
                             f"{self.max_concurrent_requests} must be >= 1")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0:
            raise ValueError(f"reward_model.timeout_s={self.timeout_s} must be > 0, max_retries={self.max_retries} "
                             f"and backoff_s={self.backoff_s} >= 0")


class RemoteRewardModel:
    """Scores (prompt, response) pairs with a reward model served over HTTP."""

    def __init__(self, config: RemoteRewardConfig) -> None:
        self.config = config
        self._endpoint = config.url.rstrip("/") + "/score"

    def _post_once(self, items: list[dict]) -> list[float]:
        body = json.dumps({"items": items}).encode()
        request = urllib.request.Request(self._endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace")
            if error.code == 429 or error.code >= 500:
                raise _Retryable(f"HTTP {error.code}: {detail}") from error
            raise RemoteRewardError(f"reward model at {self._endpoint} rejected the request with HTTP {error.code}: "
                                    f"{detail}") from error
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
            raise _Retryable(f"{type(error).__name__}: {error}") from error
        try:
            scores = json.loads(raw)["scores"]
        except (ValueError, KeyError, TypeError) as error:
            raise _Retryable(f"malformed answer ({type(error).__name__}): {raw[:200]!r}") from error
        if not isinstance(scores, list) or len(scores) != len(items):
            raise _Retryable(f"expected {len(items)} scores, got {str(scores)[:200]}")
        if not all(isinstance(score, (int, float)) and math.isfinite(score) for score in scores):
            raise _Retryable(f"non-numeric or non-finite scores: {str(scores)[:200]}")
        return [float(score) for score in scores]

    def _post(self, items: list[dict]) -> list[float]:
        delay, failures = self.config.backoff_s, []
        for attempt in range(self.config.max_retries + 1):
            try:
                return self._post_once(items)
            except _Retryable as error:
                failures.append(str(error))
                if attempt < self.config.max_retries:
                    time.sleep(delay)
                    delay *= self.config.backoff_multiplier
        raise RemoteRewardError(f"reward model at {self._endpoint} failed {len(failures)} attempts for a batch of "
                                f"{len(items)}; last error: {failures[-1]}")

    def score(self, prompts: list[str], responses: list[str], extra_fields: list[dict] | None = None) -> torch.Tensor:
        """Scores [N] for N (prompt, response) pairs; ``extra_fields`` (e.g. ground_truth) are merged into items."""
        if len(prompts) != len(responses) or (extra_fields is not None and len(extra_fields) != len(prompts)):
            raise ValueError(f"prompts ({len(prompts)}), responses ({len(responses)}) and extra_fields "
                             f"({None if extra_fields is None else len(extra_fields)}) must have the same length")
        items = [{"prompt": prompt, "response": response, **(extra_fields[index] if extra_fields else {})}
                 for index, (prompt, response) in enumerate(zip(prompts, responses))]
        batches = [items[start:start + self.config.batch_size]
                   for start in range(0, len(items), self.config.batch_size)]
        with ThreadPoolExecutor(max_workers=min(self.config.max_concurrent_requests, max(1, len(batches)))) as pool:
            results = list(pool.map(self._post, batches))
        return torch.tensor([score for batch in results for score in batch], dtype=torch.float32)
