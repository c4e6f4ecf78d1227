"""The rank-0 filter-accumulate controller: keeps the rollout engines busy and fills one batch per step.

It never waits for a whole generation batch: prompts are submitted ahead, and every group that has finished when
the controller looks is scored in one call to the grading pool, then committed in request order by a
`GroupAccumulator` (see accumulator.py for why the order is fixed). How far ahead it requests follows the keep rate
observed in this and earlier steps: enough uncommitted prompts to fill the batch with about 90% probability (a
prompt requested too late costs a whole response's latency, one requested needlessly only the tokens it got before
cancellation), with at most `inflight_cap` of them running on the engines. Prompts that finished but wait for an
earlier one to commit do not count against that cap, so a long response holds up the commit order but not the
engines (benchmarks/streaming/README.md measures why this matters when response lengths have a long tail). When
`train_batch_size` prompts are kept, what is still running is cancelled and the unused prompts go back to the data
stream. `max_num_gen_batches` caps the prompts requested (in units of
`gen_batch_size`, verl's DAPO generation batch, by default `train_batch_size`); when it is reached `on_limit` decides between a clear error and training on the partial batch.
Which prompts form a batch depends only on the data order and the per-request seeds, never on the look-ahead, so the
keep-rate history is a speed hint that checkpoints need not hold.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from megatron_cpo.config import Config
from megatron_cpo.rollout.generators import GroupGenerator
from megatron_cpo.trainer.accumulator import GroupAccumulator, GroupFilter, ScoredGroup
from megatron_cpo.trainer.prompt_stream import PromptStream, StreamPosition

logger = logging.getLogger(__name__)

GroupScorer = Callable[[list[tuple[Any, list[list[int]]]]], list[tuple[torch.Tensor, torch.Tensor, list[str]]]]
"""Scores finished groups: [(record, response token ids)] -> [(scores [n], acc [n], response texts)]."""


class GenerationLimitError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` was reached before the batch was full (on_limit=error)."""


def inflight_cap(config: Config) -> int:
    """Prompts submitted and not yet finished, at most (`rollout.max_inflight_prompts`, 0: twice the batch); finished
    ones waiting to commit do not count."""
    return config.actor_rollout_ref.rollout.max_inflight_prompts or 2 * config.data.train_batch_size


def prompt_limit(config: Config) -> int | None:
    """Prompts one step may request: `algorithm.filter_groups.max_num_gen_batches` generation batches
    (`data.gen_batch_size`) when a group filter (DAPO's or RAGEN's) is on; None: no limit."""
    groups = config.algorithm.filter_groups
    filtering = groups.enable or config.actor_rollout_ref.rollout.rollout_filter_enabled
    if not filtering or groups.max_num_gen_batches <= 0:
        return None
    return groups.max_num_gen_batches * config.data.generation_batch_size


@dataclass
class CollectedBatch:
    """What one step trains on, plus why collection stopped and its metrics. `trainable`: the step trains on these
    groups (a full batch, or a partial one under `on_limit=use_partial`); False ends the run."""
    groups: list[ScoredGroup]
    full: bool
    data_exhausted: bool
    metrics: dict[str, float] = field(default_factory=dict)
    trainable: bool = True


# Look-ahead: request enough prompts that the batch fills with about this probability (one-sided normal quantile).
FILL_PROBABILITY_Z = 1.28


def prompts_to_request(needed: int, keep_rate: float) -> int:
    """Uncommitted prompts to have in flight so that `needed` of them are kept with ~90% probability.

    The kept count of N prompts is about Binomial(N, keep_rate); this solves N p - z sqrt(N p (1 - p)) = needed
    for N (exactly `needed` when every group is kept). A shortfall costs a whole extra response latency, a
    surplus only the cancelled prompts' tokens, hence the margin."""
    if needed <= 0:
        return 0
    p = min(max(keep_rate, 0.02), 1.0)
    spread = FILL_PROBABILITY_Z * math.sqrt(p * (1.0 - p))
    root = (spread + math.sqrt(spread * spread + 4.0 * p * needed)) / (2.0 * p)
    return math.ceil(root * root - 1e-9)


def log_filter_progress(step: int, accumulator: GroupAccumulator, generation_batch: int, logged: int) -> int:
    """The seeds' per-generation-batch progress line, when the committed prompts complete one or more generation
    batches (the last, partial one once the batch is full); returns the batches reported so far. Batches completed
    by the same poll share one line (`gen batches 4-5`), so no two lines repeat the same counts."""
    committed = accumulator.next_seq
    done = math.ceil(committed / generation_batch) if accumulator.full else committed // generation_batch
    if done <= logged:
        return logged
    batches = f"gen batch {done}" if done == logged + 1 else f"gen batches {logged + 1}-{done}"
    wanted = accumulator.target_prompts
    logger.info("[filter_groups] step %d, %s: committed %d prompts, filtered %d trajectories, accumulated %d/%d",
                step, batches, committed, accumulator.stats.filtered_trajectories, min(len(accumulator.kept), wanted),
                wanted)
    return done


@dataclass
class KeepRateHistory:
    """Groups kept / committed in earlier steps, halved every step so the estimate follows the policy as it learns.
    With no history the rate starts at 1 (request exactly what is needed) and is learnt within the first step."""
    kept: float = 0.0
    committed: float = 0.0
    decay: float = 0.5

    def rate(self, kept_now: int, committed_now: int) -> float:
        return (self.kept + kept_now + 1.0) / (self.committed + committed_now + 1.0)

    def update(self, kept: int, committed: int) -> None:
        self.kept = self.decay * self.kept + kept
        self.committed = self.decay * self.committed + committed


@dataclass
class _Request:
    seq: int
    position: StreamPosition
    record: Any


class RolloutController:
    """Submits prompts to a group generator, scores and filters finished groups, returns one batch per call."""

    def __init__(self, generator: GroupGenerator, stream: PromptStream, scorer: GroupScorer, config: Config,
                 group_filter: GroupFilter | None, sampling_params_for: Callable[[int], Any],
                 poll_timeout_s: float = 600.0) -> None:
        self.generator = generator
        self.stream = stream
        self.scorer = scorer
        self.config = config  # reads data.*, algorithm.filter_groups.*, rollout.max_inflight_prompts
        self.group_filter = group_filter
        self.sampling_params_for = sampling_params_for
        self.poll_timeout_s = poll_timeout_s
        self.keep_history = KeepRateHistory()

    def collect(self, step: int) -> CollectedBatch:
        """Generate, score and filter until `train_batch_size` prompts are kept, a limit is hit or data runs out."""
        batch_size, groups_config = self.config.data.train_batch_size, self.config.algorithm.filter_groups
        start = time.perf_counter()
        accumulator = GroupAccumulator(batch_size, self.group_filter, groups_config.metric)
        requests: list[_Request] = []
        inflight: dict[str, _Request] = {}
        timing = dict.fromkeys(("timing/generated_tokens", "timing/gen_wait_s", "timing/score_s",
                                "timing/score_calls"), 0.0)
        logged_gen_batches = 0
        data_exhausted = False
        while not accumulator.full:
            data_exhausted = self._top_up(step, accumulator, requests, inflight) or data_exhausted
            if not inflight:
                break
            waited = time.perf_counter()
            finished = [(inflight.pop(group.request_id), group)
                        for group in self.generator.finished(timeout=self.poll_timeout_s) if group.request_id in inflight]
            scoring = time.perf_counter()
            accumulator.add(self._score(finished, timing))
            timing["timing/gen_wait_s"] += scoring - waited
            timing["timing/score_s"] += time.perf_counter() - scoring
            logged_gen_batches = log_filter_progress(step, accumulator, self.config.data.generation_batch_size,
                                                     logged_gen_batches)
        if inflight:
            self.generator.cancel_all()
        if accumulator.next_seq < len(requests):
            self.stream.rewind(requests[accumulator.next_seq].position)
            data_exhausted = False
        self.keep_history.update(accumulator.stats.kept, accumulator.stats.committed)
        metrics = self._metrics(accumulator, len(requests), timing, time.perf_counter() - start)
        if accumulator.full:
            logger.info("[filter_groups] step %d: accumulated enough prompts, proceeding with %d trajectories",
                        step, sum(g.n for g in accumulator.batch()))
            return CollectedBatch(accumulator.batch(), True, False, metrics)
        use_partial = groups_config.on_limit == "use_partial"
        if not data_exhausted:
            generation_batch = self.config.data.generation_batch_size
            message = (f"step {step}: num_gen_batches={math.ceil(accumulator.next_seq / generation_batch)} >= "
                       f"max_num_gen_batches={groups_config.max_num_gen_batches} with only "
                       f"{len(accumulator.kept)}/{batch_size} "
                       f"prompts kept after {prompt_limit(self.config)} prompts; the data may be too easy or too hard "
                       "for the filter. Raise algorithm.filter_groups.max_num_gen_batches, or set "
                       "algorithm.filter_groups.on_limit=use_partial to train on the partial batch")
            if not use_partial:
                raise GenerationLimitError(message)
            logger.warning("%s; training on the partial batch (on_limit=use_partial)", message)
        else:
            logger.info("[filter_groups] step %d: data exhausted after epoch %d with %d/%d prompts kept",
                        step, self.stream.total_epochs, len(accumulator.kept), batch_size)
        return CollectedBatch(accumulator.batch(), False, data_exhausted, metrics, trainable=use_partial)

    def _top_up(self, step: int, accumulator: GroupAccumulator, requests: list[_Request],
                inflight: dict[str, _Request]) -> bool:
        """Submit prompts while fewer than `inflight_cap` are on the engines and the uncommitted ones (running, or
        finished and waiting for an earlier one to commit) are fewer than the observed keep rate needs; True when
        data ran out. Counting only running prompts against the cap keeps the engines busy while a long response
        holds up the commit order; the keep-rate bound keeps the look-ahead to what can still be used."""
        keep_rate = self.keep_history.rate(accumulator.stats.kept, accumulator.stats.committed)
        wanted = prompts_to_request(self.config.data.train_batch_size - len(accumulator.kept), keep_rate)
        cap, limit = inflight_cap(self.config), prompt_limit(self.config)
        while len(requests) - accumulator.next_seq < wanted and len(inflight) < cap:
            if limit is not None and len(requests) >= limit:
                return False
            item = self.stream.next()
            if item is None:
                return True
            position, record = item
            request = _Request(len(requests), position, record)
            request_id = f"step{step}-e{position.epoch}-o{position.offset}"
            params = self.sampling_params_for(self._request_seed(step, position))
            self.generator.submit(request_id, record, params)
            requests.append(request)
            inflight[request_id] = request
        return False

    def _score(self, finished: list[tuple[_Request, Any]], timing: dict[str, float]) -> list[ScoredGroup]:
        """Score the finished groups in one scorer call (one round trip to the grading pool for all of them)."""
        if not finished:
            return []
        responses = [[sample.token_ids for sample in group.samples] for _, group in finished]
        scored = self.scorer([(request.record, group_responses)
                              for (request, _), group_responses in zip(finished, responses)])
        timing["timing/score_calls"] += 1
        timing["timing/generated_tokens"] += sum(len(r) for group_responses in responses for r in group_responses)
        return [ScoredGroup(seq=request.seq, record=request.record, prompt_token_ids=list(group.prompt_token_ids),
                            response_token_ids=group_responses,
                            rollout_log_probs=[list(x.logprobs) for x in group.samples],
                            truncated=torch.tensor([bool(x.truncated) for x in group.samples]),
                            scores=scores, acc=accs, response_texts=texts)
                for (request, group), group_responses, (scores, accs, texts) in zip(finished, responses, scored)]

    def _request_seed(self, step: int, position: StreamPosition) -> int:
        """A sampling seed fixed by (run seed, step, data position), so reruns and resumes sample identically."""
        return (self.stream.seed * 1_000_003 + step * 10_007 + position.epoch * 7_919 + position.offset) % (2**31)

    def _metrics(self, accumulator: GroupAccumulator, requested: int, timing: dict[str, float], seconds: float
                 ) -> dict[str, float]:
        size = self.config.data.train_batch_size
        metrics = accumulator.metrics()
        metrics.update(timing)
        metrics.update({
            "filter/num_gen_batches": float(math.ceil(accumulator.next_seq / size)),
            "filter/target_prompts": float(size),
            "timing/requested_prompts": float(requested),
            "timing/gen_s": seconds,
            "timing/gen_tokens_per_s": timing["timing/generated_tokens"] / max(seconds, 1e-9),
        })
        return metrics
