"""HTTP client for a remote reward model (the protocol of ``reward_server.py``), configured as ``reward.remote.*``.

Batched requests with timeouts and exponential-backoff retries, so a call ends within about
``(max_retries + 1) * timeout_s``; a non-finite score is an answer, not retried (docs/data.md).
"""
from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from megatron_cpo.config_checks import ConfigError
from megatron_cpo.rewards.config import RemoteRewardConfig


class RemoteRewardError(RuntimeError):
    """The reward model could not score a batch."""


class _Retryable(Exception):
    pass


def _jsonable(value: Any) -> Any:
    """numpy arrays and scalars (parquet ground truths) as plain lists and numbers; anything else as its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


@dataclass
class RemoteScores:
    """Model scores [N] (``failure_score`` where ``failed``), which samples failed, and the last error or None."""

    scores: torch.Tensor
    failed: torch.Tensor
    error: str | None


class RemoteRewardModel:
    """Scores (prompt, response) pairs with a reward model served over HTTP."""

    def __init__(self, config: RemoteRewardConfig) -> None:
        if not config.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote.url={config.url!r} must start with http:// or https://")
        self.config = config
        self.endpoint = config.url.rstrip("/") + "/score"

    def _post_once(self, items: list[dict]) -> list[float]:
        body = json.dumps({"items": items}, default=_jsonable).encode()
        request = urllib.request.Request(self.endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            detail = error.read()[:300].decode("utf-8", "replace")
            if error.code == 429 or error.code >= 500:
                raise _Retryable(f"HTTP {error.code}: {detail}") from error
            raise RemoteRewardError(f"reward model at {self.endpoint} rejected the request with HTTP {error.code}: "
                                    f"{detail}") from error
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as error:
            raise _Retryable(f"{type(error).__name__}: {error}") from error
        try:
            scores = json.loads(raw)["scores"]
        except (ValueError, KeyError, TypeError) as error:
            raise _Retryable(f"malformed answer ({type(error).__name__}): {raw[:200]!r}") from error
        if not isinstance(scores, list) or len(scores) != len(items):
            raise _Retryable(f"expected {len(items)} scores, got {str(scores)[:200]}")
        if not all(isinstance(score, (int, float)) for score in scores):
            raise _Retryable(f"non-numeric scores: {str(scores)[:200]}")
        return [float(score) for score in scores]  # NaN / Infinity are numbers: the reward manager refuses them

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
        raise RemoteRewardError(f"reward model at {self.endpoint} failed {len(failures)} attempts for a batch of "
                                f"{len(items)}; last error: {failures[-1]} (check that the server is up and "
                                "answers within reward.remote.timeout_s, or set reward.remote.on_error=failure_score)")

    def _post_or_fail(self, items: list[dict]) -> tuple[list[float], str | None]:
        try:
            return self._post(items), None
        except RemoteRewardError as error:
            if self.config.on_error == "raise":
                raise
            return [self.config.failure_score] * len(items), str(error)

    def score_batch(self, prompts: list[str], responses: list[str],
                    extra_fields: list[dict] | None = None) -> RemoteScores:
        """Score N (prompt, response) pairs; ``extra_fields`` (data_source, ground_truth, ...) are merged into the
        items. Raises ``RemoteRewardError`` on failure unless ``on_error`` is ``failure_score``."""
        if len(prompts) != len(responses) or (extra_fields is not None and len(extra_fields) != len(prompts)):
            raise ValueError(f"prompts ({len(prompts)}), responses ({len(responses)}) and extra_fields "
                             f"({None if extra_fields is None else len(extra_fields)}) must have the same length")
        items = [{"prompt": prompt, "response": response, **(extra_fields[index] if extra_fields else {})}
                 for index, (prompt, response) in enumerate(zip(prompts, responses))]
        batches = [items[start:start + self.config.batch_size]
                   for start in range(0, len(items), self.config.batch_size)]
        with ThreadPoolExecutor(max_workers=min(self.config.max_concurrent, max(1, len(batches)))) as pool:
            results = list(pool.map(self._post_or_fail, batches))
        scores = torch.tensor([score for batch, _ in results for score in batch], dtype=torch.float32)
        failed = torch.tensor([error is not None for (batch, error) in results for _ in batch], dtype=torch.bool)
        errors = [error for _, error in results if error is not None]
        return RemoteScores(scores, failed, errors[-1] if errors else None)

    def score(self, prompts: list[str], responses: list[str], extra_fields: list[dict] | None = None) -> torch.Tensor:
        """Scores [N] for N (prompt, response) pairs (see ``score_batch``)."""
        return self.score_batch(prompts, responses, extra_fields).scores
