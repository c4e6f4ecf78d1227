"""A distillation teacher served by vLLM engines: Ray-spawned engines of its own size and count (`kind: engines`,
started by the same `RolloutManager` as the rollout's), or running `megatron-cpo rollout` servers (`kind: server`).

The driver scores each group as it finishes (`submit`), overlapping the other rollouts, and takes the scores when it
builds the step batch (`collect`); `score` does both for a batch at once. A teacher larger than the trainer's memory
costs the trainer nothing: it lives in the engines. The engines score at temperature 1 with `prompt_logprobs = k`
(rollout/scoring.py); an engine that dies mid-run is handled as a rollout engine is (its requests go to the others).
"""
from __future__ import annotations

import uuid
from collections.abc import Sequence

from megatron_cpo.rollout.config import RolloutEngineConfig
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest
from megatron_cpo.rollout.teacher_config import DistillationConfig
from megatron_cpo.rollout.teachers import TeacherScores
from megatron_cpo.rollout.types import EngineLaunchConfig

DEFAULT_MAX_LOGPROBS = 20  # vLLM's own default


class EngineTeacher:
    """A `Teacher` (rollout/teachers.py) on `RolloutEngines`; `owns_engines`: `shutdown` stops them."""

    def __init__(self, name: str, engines: RolloutEngines, topk: int, owns_engines: bool = True) -> None:
        self.name = name
        self.engines = engines
        self.topk = topk
        self.owns_engines = owns_engines
        # engines shared by several runs (one process, e.g. a test session) may still hold a finished run's requests
        self._prefix = f"teacher-{name}-{uuid.uuid4().hex[:8]}/"

    def submit(self, request_id: str, prompt: Sequence[int], responses: Sequence[Sequence[int]]) -> None:
        """Start scoring one group's responses (e.g. as soon as the group finished generating)."""
        self.engines.submit_score(ScoreRequest(self._prefix + request_id, list(prompt), [list(r) for r in responses],
                                               self.topk))

    def collect(self, request_ids: Sequence[str], timeout: float | None = None) -> dict[str, TeacherScores]:
        """The scores of submitted groups by id, each [responses, its longest response(, k)]; a non-finite
        log-prob is refused naming the response (`TeacherScoreError`)."""
        groups = self.engines.collect_scores([self._prefix + request_id for request_id in request_ids], timeout)
        return {request_id: self._scores(request_id, groups[self._prefix + request_id]) for request_id in request_ids}

    def score(self, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TeacherScores:
        """Every response after its prompt, one group per row, [N, longest response(, k)]."""
        ids = [f"row{row}-{uuid.uuid4().hex[:8]}" for row in range(len(responses))]
        for request_id, prompt, response in zip(ids, prompts, responses):
            self.submit(request_id, prompt, [response])
        groups = self.engines.collect_scores([self._prefix + request_id for request_id in ids])
        rows = [groups[self._prefix + request_id].responses[0] for request_id in ids]
        return self._checked(rows, ids, max((len(r) for r in responses), default=0))

    def _scores(self, request_id: str, group: ScoredGroup) -> TeacherScores:
        names = [f"{request_id}/sample{i}" for i in range(len(group.responses))]
        return self._checked(group.responses, names, max((len(r.log_probs) for r in group.responses), default=0))

    def _checked(self, rows, names: list[str], width: int) -> TeacherScores:
        scores = TeacherScores.from_rows([(r.log_probs, r.topk_ids, r.topk_log_probs) for r in rows], width,
                                         self.topk)
        scores.check_finite([len(r.log_probs) for r in rows], names, self.name)
        return scores

    def shutdown(self) -> None:
        if self.owns_engines:
            self.engines.shutdown()


def teacher_launch_config(name: str, distillation: DistillationConfig, dtype: str, context: int, seed: int,
                          ray_address: str) -> EngineLaunchConfig:
    """The launch settings of teacher `name`'s own engines (`kind: engines`): `distillation.replicas(name)` engines
    of `inference.tensor_model_parallel_size` on its `model_path`, holding `context` tokens (prompt + response + 1)
    unless `inference.max_model_len` says more, in the actor's `dtype` unless `inference.dtype` says, able to return
    the loss's top-k."""
    teacher = distillation.teacher_models[name]
    inference = teacher.inference
    engines = RolloutEngineConfig(num_engines=distillation.replicas(name),
                                  tensor_model_parallel_size=inference.tensor_model_parallel_size,
                                  kv_cache_gib=inference.kv_cache_gib,
                                  gpu_memory_utilization=inference.gpu_memory_utilization,
                                  enable_chunked_prefill=inference.enable_chunked_prefill,
                                  max_num_batched_tokens=inference.max_num_batched_tokens, ray_address=ray_address)
    max_logprobs = max(DEFAULT_MAX_LOGPROBS, distillation.distillation_loss.teacher_topk)
    return EngineLaunchConfig(model_path=teacher.model_path, engines=engines, dtype=inference.dtype or dtype,
                              max_model_len=max(context, inference.max_model_len or 0), seed=seed,
                              max_num_seqs=inference.max_num_seqs,
                              enable_prefix_caching=inference.enable_prefix_caching, max_logprobs=max_logprobs,
                              frozen_weights=True)


def start_engine_teacher(name: str, distillation: DistillationConfig, dtype: str, context: int, seed: int,
                         ray_address: str, server_timeout_s: float = 30.0) -> EngineTeacher:
    """Start (`kind: engines`) or reach (`kind: server`) teacher `name`'s engines; rank 0 only. With Ray already
    running in this process (the rollout's engines), the teacher's join that cluster: stop the teacher first."""
    teacher = distillation.teacher_models[name]
    topk = distillation.distillation_loss.teacher_topk
    if teacher.kind == "server":
        from megatron_cpo.rollout.http_protocol import read_token_file
        from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager

        token = read_token_file(teacher.server_token_file, f"distillation.teacher_models.{name}.server_token_file")
        client = ServerClientConfig(urls=tuple(teacher.server_urls), token=token, timeout_s=server_timeout_s,
                                    min_model_len=context, frozen_weights=True)
        return EngineTeacher(name, ServerRolloutManager(client), topk)
    if teacher.kind != "engines":
        raise ValueError(f"distillation.teacher_models.{name}.kind={teacher.kind} is not served by engines")
    from megatron_cpo.rollout.manager import RolloutManager

    launch = teacher_launch_config(name, distillation, dtype, context, seed, ray_address)
    return EngineTeacher(name, RolloutManager(launch), topk)
