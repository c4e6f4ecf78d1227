"""The rank-0 filter-accumulate controller: keeps the rollout engines busy and fills one batch per step.

It never waits for a whole generation batch: prompts are submitted ahead, groups are scored as they finish and
committed in request order by a `GroupAccumulator` (see accumulator.py for why the order is fixed). The number of
prompts in flight follows the observed keep rate, so with a strict filter more prompts are requested sooner. When
`train_batch_size` prompts are kept, what is still running is cancelled and the unused prompts go back to the data
stream. `max_num_gen_batches` caps the prompts requested (in units of `train_batch_size`); when it is reached
`on_limit` decides between a clear error and training on the partial batch.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_cpo.trainer.accumulator import GroupAccumulator, GroupFilter, ScoredGroup
from megatron_cpo.trainer.prompt_stream import PromptStream, StreamPosition

logger = logging.getLogger(__name__)

GroupScorer = Callable[[list[tuple[Any, list[list[int]]]]], list[tuple[torch.Tensor, torch.Tensor, list[str]]]]
"""Scores finished groups: [(record, response token ids)] -> [(scores [n], acc [n], response texts)]."""


class GenerationLimitError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` was reached before the batch was full (on_limit=error)."""


@dataclass
class ControllerSettings:
    train_batch_size: int
    max_num_gen_batches: int = 0
    on_limit: str = "error"
    max_inflight_prompts: int = 0
    filter_metric: str = "acc"
    poll_timeout_s: float = 600.0

    @property
    def inflight_cap(self) -> int:
        return self.max_inflight_prompts or 2 * self.train_batch_size

    @property
    def prompt_limit(self) -> int | None:
        return self.max_num_gen_batches * self.train_batch_size if self.max_num_gen_batches > 0 else None


@dataclass
class CollectedBatch:
    """What one step trains on, plus why collection stopped and its metrics."""
    groups: list[ScoredGroup]
    full: bool
    data_exhausted: bool
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _Request:
    seq: int
    position: StreamPosition
    record: Any


class RolloutController:
    """Submits prompts to a rollout manager, scores and filters finished groups, returns one batch per call."""

    def __init__(self, manager: Any, stream: PromptStream, scorer: GroupScorer, settings: ControllerSettings,
                 group_filter: GroupFilter | None, sampling_params_for: Callable[[int], Any]) -> None:
        self.manager = manager
        self.stream = stream
        self.scorer = scorer
        self.settings = settings
        self.group_filter = group_filter
        self.sampling_params_for = sampling_params_for

    def collect(self, step: int) -> CollectedBatch:
        """Generate, score and filter until `train_batch_size` prompts are kept, a limit is hit or data runs out."""
        s = self.settings
        start = time.perf_counter()
        acc = GroupAccumulator(s.train_batch_size, self.group_filter, s.filter_metric)
        requests: list[_Request] = []
        inflight: dict[str, _Request] = {}
        generated_tokens = 0
        logged_gen_batches = 0
        data_exhausted = False
        while not acc.full:
            data_exhausted = self._top_up(step, acc, requests, inflight) or data_exhausted
            if not inflight:
                break
            for group in self.manager.completed(timeout=s.poll_timeout_s):
                request = inflight.pop(group.request_id, None)
                if request is None:
                    continue
                responses = [sample.token_ids for sample in group.samples]
                generated_tokens += sum(len(r) for r in responses)
                scores, accs, texts = self.scorer([(request.record, responses)])[0]
                acc.add([ScoredGroup(
                    seq=request.seq, record=request.record, prompt_token_ids=list(group.prompt_token_ids),
                    response_token_ids=responses, rollout_log_probs=[list(x.logprobs) for x in group.samples],
                    truncated=torch.tensor([bool(x.truncated) for x in group.samples]),
                    scores=scores, acc=accs, response_texts=texts)])
                logged_gen_batches = self._log_progress(step, acc, logged_gen_batches)
                if acc.full:
                    break
                data_exhausted = self._top_up(step, acc, requests, inflight) or data_exhausted
        if inflight:
            self.manager.cancel_all()
        if acc.next_seq < len(requests):
            self.stream.rewind(requests[acc.next_seq].position)
            data_exhausted = False
        metrics = self._metrics(acc, len(requests), generated_tokens, time.perf_counter() - start)
        if acc.full:
            logger.info("[filter_groups] step %d: accumulated enough prompts, proceeding with %d trajectories",
                        step, sum(g.n for g in acc.batch()))
            return CollectedBatch(acc.batch(), True, False, metrics)
        if not data_exhausted:
            limit = s.prompt_limit
            message = (f"step {step}: num_gen_batches={math.ceil(acc.next_seq / s.train_batch_size)} >= "
                       f"max_num_gen_batches={s.max_num_gen_batches} with only {len(acc.kept)}/{s.train_batch_size} "
                       f"prompts kept after {limit} prompts; the data may be too easy or too hard for the filter. "
                       "Raise algorithm.filter_groups.max_num_gen_batches, or set "
                       "algorithm.filter_groups.on_limit=use_partial to train on the partial batch")
            if s.on_limit == "error":
                raise GenerationLimitError(message)
            logger.warning("%s; training on the partial batch (on_limit=use_partial)", message)
        else:
            logger.info("[filter_groups] step %d: data exhausted after epoch %d with %d/%d prompts kept",
                        step, self.stream.total_epochs, len(acc.kept), s.train_batch_size)
        return CollectedBatch(acc.batch(), False, data_exhausted, metrics)

    def _top_up(self, step: int, acc: GroupAccumulator, requests: list[_Request],
                inflight: dict[str, _Request]) -> bool:
        """Submit prompts until enough are outstanding for the observed keep rate; True when data ran out."""
        s = self.settings
        keep_rate = (acc.stats.kept + 1) / (acc.stats.committed + 1)
        needed = s.train_batch_size - len(acc.kept)
        wanted = min(s.inflight_cap, math.ceil(needed / max(keep_rate, 0.05)))
        while len(requests) - acc.next_seq < wanted:
            if s.prompt_limit is not None and len(requests) >= s.prompt_limit:
                return False
            item = self.stream.next()
            if item is None:
                return True
            position, record = item
            request = _Request(len(requests), position, record)
            request_id = f"step{step}-e{position.epoch}-o{position.offset}"
            params = self.sampling_params_for(self._request_seed(step, position))
            self.manager.submit(request_id, list(record.prompt_ids), params)
            requests.append(request)
            inflight[request_id] = request
        return False

    def _request_seed(self, step: int, position: StreamPosition) -> int:
        """A sampling seed fixed by (run seed, step, data position), so reruns and resumes sample identically."""
        return (self.stream.seed * 1_000_003 + step * 10_007 + position.epoch * 7_919 + position.offset) % (2**31)

    def _log_progress(self, step: int, acc: GroupAccumulator, logged: int) -> int:
        """The seeds' per-generation-batch line, once per train_batch_size committed prompts."""
        size = self.settings.train_batch_size
        while (logged + 1) * size <= acc.next_seq or (acc.full and logged * size < acc.next_seq):
            logged += 1
            logger.info("[filter_groups] step %d, gen batch %d: committed %d prompts, filtered %d trajectories, "
                        "accumulated %d/%d", step, logged, acc.next_seq, acc.stats.filtered_trajectories,
                        min(len(acc.kept), size), size)
        return logged

    def _metrics(self, acc: GroupAccumulator, requested: int, generated_tokens: int, seconds: float
                 ) -> dict[str, float]:
        size = self.settings.train_batch_size
        metrics = acc.metrics()
        metrics.update({
            "filter/num_gen_batches": float(math.ceil(acc.next_seq / size)),
            "filter/target_prompts": float(size),
            "timing/requested_prompts": float(requested),
            "timing/generated_tokens": float(generated_tokens),
            "timing/gen_s": seconds,
            "timing/gen_tokens_per_s": generated_tokens / max(seconds, 1e-9),
        })
        return metrics
