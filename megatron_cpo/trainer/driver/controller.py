"""The rank-0 filter-accumulate controller: keeps the rollout engines busy and fills one batch per step.

Prompts are submitted as the `Admission` strategy allows; finished groups are graded in one call and committed in
request order by a `GroupAccumulator`. `max_num_gen_batches` caps one step's requests (docs/trainer.md).
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_cpo.algorithms.config import FilterGroupsConfig, RolloutFilterConfig
from megatron_cpo.data.config import DataConfig
from megatron_cpo.rollout.generators import GroupGenerator
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.driver.accumulator import GroupAccumulator, GroupFilter, ScoredGroup, episode_fields
from megatron_cpo.trainer.driver.admission import Admission, EngineIdleWatch, OpenRequests, Request, staleness_metrics
from megatron_cpo.trainer.driver.batching import batch_loss_mask
from megatron_cpo.trainer.driver.prompt_stream import PromptStream, StreamPosition

logger = logging.getLogger(__name__)

GroupScorer = Callable[[list[tuple[Any, list[RolloutSample]]]], list[tuple[torch.Tensor, torch.Tensor, list[str]]]]
"""Scores finished groups: [(record, samples)] -> [(scores [n], acc [n], response texts)]."""


class GenerationLimitError(RuntimeError):
    """`algorithm.filter_groups.max_num_gen_batches` was reached before the batch was full (on_limit=error)."""


def prompt_limit(filter_groups: FilterGroupsConfig, rollout_filter: RolloutFilterConfig, generation_batch_size: int
                 ) -> int | None:
    """Prompts one step may request: `algorithm.filter_groups.max_num_gen_batches` generation batches
    (`data.gen_batch_size`) when a group filter (DAPO's, or RAGEN's of the `rollout_filter_*` keys) is on; None: no
    limit."""
    filtering = filter_groups.enable or rollout_filter.rollout_filter_enabled
    if not filtering or filter_groups.max_num_gen_batches <= 0:
        return None
    return filter_groups.max_num_gen_batches * generation_batch_size


@dataclass
class CollectedBatch:
    """What one step trains on, plus why collection stopped and its metrics. `trainable`: the step trains on these
    groups (a full batch, or a partial one under `on_limit=use_partial`); False ends the run."""
    groups: list[ScoredGroup]
    full: bool
    data_exhausted: bool
    metrics: dict[str, float] = field(default_factory=dict)
    trainable: bool = True
    policy_version: int | None = None  # the weight version the batch is trained with (the engines' when collected)


def log_filter_progress(step: int, accumulator: GroupAccumulator, generation_batch: int, logged: int) -> int:
    """The seeds' per-generation-batch progress line, when the committed prompts complete one or more generation
    batches (the last, partial one once the batch is full); returns the batches reported so far. Batches completed
    by the same poll share one line (`gen batches 4-5`), so no two lines repeat the same counts."""
    committed = accumulator.consumed  # this batch's (with asynchronous training seq counts the run's)
    done = math.ceil(committed / generation_batch) if accumulator.full else committed // generation_batch
    if done <= logged:
        return logged
    batches = f"gen batch {done}" if done == logged + 1 else f"gen batches {logged + 1}-{done}"
    wanted = accumulator.target_prompts
    logger.info("[filter_groups] step %d, %s: committed %d prompts, filtered %d trajectories, accumulated %d/%d",
                step, batches, committed, accumulator.stats.filtered_trajectories, min(len(accumulator.kept), wanted),
                wanted)
    return done


class RolloutController:
    """Submits prompts to a group generator as its `Admission` allows, scores and filters finished groups, returns
    one batch per call.

    `data`: the batch size and generation batch (`data.*`); `filter_groups`: what filter-groups judges by and what
    happens at `prompt_limit` (prompts one step may request, `prompt_limit()`). With an admission that carries unused
    prompts (asynchronous training) groups received elsewhere meanwhile (validation shares the engines) are handed to
    it with `receive`."""

    def __init__(self, generator: GroupGenerator, stream: PromptStream, scorer: GroupScorer, admission: Admission,
                 group_filter: GroupFilter | None, sampling_params_for: Callable[[int], Any], data: DataConfig,
                 filter_groups: FilterGroupsConfig | None = None, prompt_limit: int | None = None,
                 poll_timeout_s: float = 600.0) -> None:
        self.generator = generator
        self.stream = stream
        self.scorer = scorer
        self.admission = admission
        self.group_filter = group_filter
        self.sampling_params_for = sampling_params_for
        self.batch_size, self.generation_batch_size = data.train_batch_size, data.generation_batch_size
        self.filter_groups = filter_groups or FilterGroupsConfig()
        self.prompt_limit = prompt_limit
        self.poll_timeout_s = poll_timeout_s
        self.open = OpenRequests()
        self.idle = EngineIdleWatch()
        self._received: list[RolloutGroup] = []

    def collect(self, step: int, policy_version: int | None = None) -> CollectedBatch:
        """Generate, score and filter until `train_batch_size` prompts are kept, a limit is hit or data runs out.
        `policy_version`: the engines' weight version now (`RolloutEngines.weight_version`), which is also the
        version of the trainer's weights that will train the batch."""
        start, started_at = time.perf_counter(), time.time()
        self.open = open_ = self.admission.begin(self.open, policy_version)
        accumulator = GroupAccumulator(self.batch_size, self.group_filter, self.filter_groups.metric,
                                       start_seq=open_.first, pending=open_.finished)
        timing = dict.fromkeys(("timing/generated_tokens", "timing/gen_wait_s", "timing/score_s",
                                "timing/score_calls", "rollout/generated_samples"), 0.0)
        logged_gen_batches = 0
        data_exhausted = False
        arrived = self._take(self._received + self._poll())
        self._received = []
        idle = self.idle.idle_until(started_at)
        accumulator.add(self._score(arrived, timing))
        while not accumulator.full:
            data_exhausted = self._top_up(step, accumulator) or data_exhausted
            if not open_.running:
                break
            waited = time.perf_counter()
            finished = self._take(self.generator.finished(timeout=self.poll_timeout_s))
            scoring = time.perf_counter()
            accumulator.add(self._score(finished, timing))
            timing["timing/gen_wait_s"] += scoring - waited
            timing["timing/score_s"] += time.perf_counter() - scoring
            logged_gen_batches = log_filter_progress(step, accumulator, self.generation_batch_size,
                                                     logged_gen_batches)
        batch = accumulator.batch() if accumulator.full else None
        requested = open_.issued - accumulator.start_seq
        self.admission.hand_out(accumulator, policy_version)
        if batch is not None:
            self._top_up(step, accumulator)  # the next batches' prompts while the trainer updates, if admitted
        self.open, rewound = self.admission.release_unused(self.open, accumulator, self.generator, self.stream)
        data_exhausted = data_exhausted and not rewound
        self.idle.hand_out(time.time(), self.open.running)
        metrics = self._metrics(accumulator, requested, timing, time.perf_counter() - start)
        metrics.update(self._async_metrics(accumulator, policy_version, idle))
        if batch is not None:
            logger.info("[filter_groups] step %d: accumulated enough prompts, proceeding with %d trajectories",
                        step, sum(g.n for g in batch))
            return CollectedBatch(batch, True, False, metrics, policy_version=policy_version)
        return self._short_batch(step, accumulator, data_exhausted, metrics, policy_version)

    def _short_batch(self, step: int, accumulator: GroupAccumulator, data_exhausted: bool,
                     metrics: dict[str, float], policy_version: int | None) -> CollectedBatch:
        """The partial batch when the data ran out or `prompt_limit` was reached (`on_limit` decides whether it
        trains or the run stops with `GenerationLimitError`)."""
        groups_config = self.filter_groups
        use_partial = groups_config.on_limit == "use_partial"
        if not data_exhausted:
            message = (f"step {step}: num_gen_batches={math.ceil(accumulator.consumed / self.generation_batch_size)}"
                       f" >= max_num_gen_batches={groups_config.max_num_gen_batches} with only "
                       f"{len(accumulator.kept)}/{self.batch_size} "
                       f"prompts kept after {self.prompt_limit} prompts; the data may be too easy or too hard "
                       "for the filter. Raise algorithm.filter_groups.max_num_gen_batches, or set "
                       "algorithm.filter_groups.on_limit=use_partial to train on the partial batch")
            if not use_partial:
                raise GenerationLimitError(message)
            logger.warning("%s; training on the partial batch (on_limit=use_partial)", message)
        else:
            logger.info("[filter_groups] step %d: data exhausted after epoch %d with %d/%d prompts kept",
                        step, self.stream.total_epochs, len(accumulator.kept), self.batch_size)
        return CollectedBatch(accumulator.batch(), False, data_exhausted, metrics, trainable=use_partial,
                              policy_version=policy_version)

    def receive(self, groups: list[RolloutGroup]) -> None:
        """Groups of this controller's requests that someone else took from the engines (validation, which shares
        them while training requests are in flight); the next `collect` uses them."""
        self._received.extend(groups)

    def state_dict(self) -> dict[str, int]:
        """The data position to resume from: the first prompt not yet trained (a prompt still in flight, or
        finished and waiting, is generated again after a resume; none is lost or trained twice)."""
        state = self.stream.state_dict()
        position = self.open.first_position()
        if position is not None:
            state.update(epoch=position.epoch, offset=position.offset)
        return state

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a saved position with nothing in flight."""
        self.stream.load_state_dict(state)
        self.open = OpenRequests()

    def _poll(self) -> list[RolloutGroup]:
        """Groups that have finished by now, without waiting (asynchronous training: those finished while the
        trainer updated, so their finish times are known before collecting starts)."""
        if not self.open.running:
            return []
        try:
            return self.generator.finished(timeout=0)
        except TimeoutError:
            return []

    def _take(self, groups: list[RolloutGroup]) -> list[tuple[Request, RolloutGroup]]:
        """This controller's requests among finished groups, now no longer running."""
        taken = []
        for group in groups:
            request = self.open.running.pop(group.request_id, None)
            if request is not None:
                self.idle.finished(group.request_id, group.finished_at)
                taken.append((request, group))
        return taken

    def _top_up(self, step: int, accumulator: GroupAccumulator) -> bool:
        """Submit prompts while the admission admits them, fewer than its `inflight_cap` are on the engines and the
        step is within `prompt_limit`; True when data ran out. Only running prompts count against the cap, so a long
        response that holds up the commit order does not keep the engines idle."""
        open_, limit = self.open, self.prompt_limit
        counted_from = accumulator.next_seq if accumulator.full else accumulator.start_seq  # full: the next batch's
        while len(open_.running) < self.admission.inflight_cap:
            if not self.admission.admits(accumulator, open_):
                return False
            if limit is not None and open_.issued - counted_from >= limit:
                return False
            item = self.stream.next()
            if item is None:
                return True
            position, record = item
            request_id = f"step{step}-e{position.epoch}-o{position.offset}"
            self.generator.submit(request_id, record, self.sampling_params_for(self._request_seed(step, position)))
            open_.add(request_id, Request(open_.issued, position, record))
        return False

    def _score(self, finished: list[tuple[Request, RolloutGroup]], timing: dict[str, float]) -> list[ScoredGroup]:
        """Score the finished groups in one scorer call (one round trip to the grading pool for all of them)."""
        if not finished:
            return []
        responses = [[sample.token_ids for sample in group.samples] for _, group in finished]
        # ReMax's greedy answer is graded in the same call, after the group's samples (not trained on)
        scored = self.scorer([(request.record, group.samples + ([group.greedy_baseline] if group.greedy_baseline
                                                                 else [])) for request, group in finished])
        timing["timing/score_calls"] += 1
        timing["timing/generated_tokens"] += sum(len(r) for group_responses in responses for r in group_responses)
        timing["rollout/generated_samples"] += sum(len(group_responses) for group_responses in responses)
        return [ScoredGroup(seq=request.seq, record=request.record, prompt_token_ids=list(group.prompt_token_ids),
                            response_token_ids=group_responses,
                            rollout_log_probs=[list(x.logprobs) for x in group.samples],
                            truncated=torch.tensor([bool(x.truncated) for x in group.samples]),
                            **_split_greedy_score(len(group.samples), *graded),
                            policy_versions=_token_versions(group.samples), request_id=group.request_id,
                            **episode_fields(group.samples))
                for (request, group), group_responses, graded in zip(finished, responses, scored)]

    def _request_seed(self, step: int, position: StreamPosition) -> int:
        """A sampling seed fixed by (run seed, the admission's step for it, data position), so reruns and resumes
        sample identically."""
        step = self.admission.request_seed_step(step)
        return (self.stream.seed * 1_000_003 + step * 10_007 + position.epoch * 7_919 + position.offset) % (2**31)

    def _metrics(self, accumulator: GroupAccumulator, requested: int, timing: dict[str, float], seconds: float
                 ) -> dict[str, float]:
        size = self.batch_size
        metrics = accumulator.metrics()
        metrics.update(timing)
        metrics.update({
            "filter/num_gen_batches": float(math.ceil(accumulator.consumed / size)),
            "filter/target_prompts": float(size),
            "timing/requested_prompts": float(requested),
            "timing/gen_s": seconds,
            "timing/gen_tokens_per_s": timing["timing/generated_tokens"] / max(seconds, 1e-9),
        })
        return metrics

    def _async_metrics(self, accumulator: GroupAccumulator, policy_version: int | None, engine_idle: float | None
                       ) -> dict[str, float]:
        """The engines' idle time since the last batch was handed out (`timing/engine_idle_s`; the trainer idles
        for `timing/gen_s`), what the admission carries to the next batches (`async/buffered_groups` finished,
        `async/in_flight` generating), and the batch's staleness (admission.staleness_metrics: per sample or
        episode, and per sampled token)."""
        metrics = {} if engine_idle is None else {"timing/engine_idle_s": engine_idle}
        metrics.update(self.admission.buffer_metrics(self.open))
        kept = accumulator.kept[: accumulator.target_prompts]
        if policy_version is not None and kept and all(g.policy_versions is not None for g in kept):
            metrics.update(staleness_metrics(RaggedRows.cat([g.policy_versions for g in kept]), policy_version,
                                             batch_loss_mask(kept)))
        return metrics


def _split_greedy_score(n: int, scores: torch.Tensor, acc: torch.Tensor, texts: list[str]) -> dict[str, Any]:
    """A group's grading as ScoredGroup fields: its `n` samples', and the greedy answer's score graded after them
    (ReMax's baseline; None when the group has none)."""
    return {"scores": scores[:n], "acc": acc[:n], "response_texts": texts[:n],
            "greedy_score": float(scores[n]) if len(scores) > n else None}


def _token_versions(samples: list[RolloutSample]) -> RaggedRows | None:
    """The samples' per-token weight versions as ragged rows (None when an engine did not report them)."""
    if any(sample.policy_versions is None for sample in samples):
        return None
    return RaggedRows.from_lists([sample.policy_versions for sample in samples])
