"""What rank 0 owns besides the model: engines, graders, the controller, validation, and the weight push.

`RolloutSide` is built on rank 0 only; `push_weights` is collective (every rank exports its layers, the TP leader of
each pipeline stage streams them into the engines).
"""
from __future__ import annotations

import math
import os
import time
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_cpo.config import Config
from megatron_cpo.data.dataset import DatasetConfig, PromptDataset
from megatron_cpo.data.hints import HintConfig, HintReader, build_hint_contexts
from megatron_cpo.models import iter_hf_weights
from megatron_cpo.rewards.manager import RewardConfig, RewardManager
from megatron_cpo.rewards.registry import register_custom_graders
from megatron_cpo.rewards.sandbox import SandboxSettings
from megatron_cpo.rollout import RolloutManager, SamplingParams, send_from_pipeline_stages
from megatron_cpo.rollout.modes import build_rollout_manager
from megatron_cpo.trainer.accumulator import ScoredGroup, selection_from_config
from megatron_cpo.trainer.controller import ControllerSettings, RolloutController
from megatron_cpo.trainer.prompt_stream import PromptStream


# Ray's token authentication settings of the cluster rank 0 started; other ranks need them to connect to it.
RAY_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def load_dataset(files: list[str], tokenizer: Any, config: Config, shuffle: bool) -> PromptDataset:
    """Read and check a data file list; every data_source needs a grader unless one function grades them all."""
    data = config.data
    return PromptDataset(DatasetConfig(files=files, shuffle=shuffle, max_prompt_length=data.max_prompt_length,
                                       truncation=data.truncation, filter_overlong_prompts=data.filter_overlong_prompts,
                                       prompt_key=data.prompt_key, seed=config.trainer.seed,
                                       check_graders=not config.reward_function_spec), tokenizer)


def build_reward_manager(config: Config) -> RewardManager:
    """The grading pool of `reward.*` (and the remote reward model of `reward.remote.*` when enabled)."""
    return RewardManager(RewardConfig(
        num_workers=config.reward.num_workers, reward_fn_timeout_s=config.reward.timeout_s,
        custom_graders=dict(config.reward.custom_graders), custom_reward_function=config.reward_function_spec or None,
        sandbox=SandboxSettings(config.reward.sandbox.mode, config.reward.sandbox_fusion.url,
                                config.reward.sandbox_fusion.max_concurrent, config.reward.sandbox_fusion.memory_limit_mb),
        remote=config.reward.remote))


class RolloutSide:
    """Rank 0's engines, reward pool, data and controller for one run. A `manager` passed in (already running
    engines, e.g. shared by tests or a notebook) is used and left running; otherwise engines are started here."""

    def __init__(self, config: Config, tokenizer: Any, manager: RolloutManager | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        data, rollout = config.data, config.actor_rollout_ref.rollout
        register_custom_graders(config.reward.custom_graders)
        self.train_data = load_dataset(data.train_files, tokenizer, config, data.shuffle)
        self.val_data = load_dataset(data.val_files, tokenizer, config, False) if data.val_files else None
        self.stream = PromptStream(self.train_data, config.trainer.total_epochs, config.trainer.seed, data.shuffle)
        self.owns_manager = manager is None
        self.manager = manager or build_rollout_manager(config)  # rollout.mode: ray, server or colocate
        self.rewards = build_reward_manager(config)
        self.hint_reader = HintReader(data.hint_key)
        groups = config.algorithm.filter_groups
        self.controller = RolloutController(
            self.manager, self.stream, self.score_groups,
            ControllerSettings(train_batch_size=data.train_batch_size,
                               max_num_gen_batches=groups.max_num_gen_batches
                               if groups.enable or rollout.rollout_filter_enabled else 0,
                               on_limit=groups.on_limit, max_inflight_prompts=rollout.max_inflight_prompts,
                               filter_metric=groups.metric, gen_batch_size=data.gen_batch_size),
            selection_from_config(config), self.sampling_params)
        self.remote_counts: Counter = Counter()  # the remote reward model's numbers since they were last logged

    def sampling_params(self, seed: int | None, n: int | None = None, greedy: bool = False) -> SamplingParams:
        rollout = self.config.actor_rollout_ref.rollout
        return SamplingParams(n=n or rollout.n, temperature=0.0 if greedy else rollout.temperature,
                              top_p=1.0 if greedy else rollout.top_p, top_k=-1 if greedy else rollout.top_k,
                              max_tokens=self.config.data.max_response_length,
                              stop_token_ids=(self.tokenizer.eos_token_id,), seed=seed)

    def score_groups(self, items: list[tuple[Any, list[list[int]]]], remote_counts: Counter | None = None
                     ) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
        """Decode and grade every response of the given groups in one call to the grading pool; the remote reward
        model's numbers are added to `remote_counts` (default: the training step's, see `remote_reward_metrics`)."""
        texts = [[self.tokenizer.decode(r, skip_special_tokens=True) for r in responses] for _, responses in items]
        flat_records = [record for (record, responses) in items for _ in responses]
        prompts = None
        if self.rewards.remote is not None:  # the reward model reads the prompt as the policy saw it (chat template)
            prompts = [self.tokenizer.decode(record.prompt_ids, skip_special_tokens=False)
                       for record, responses in items for _ in responses]
        result = self.rewards.score([r.data_source for r in flat_records], [t for ts in texts for t in ts],
                                    [r.ground_truth for r in flat_records], [r.extra_info for r in flat_records],
                                    prompts)
        if "reward/remote/failed" in result.metrics:
            counts = self.remote_counts if remote_counts is None else remote_counts
            counts.update({"samples": len(flat_records), "failed": result.metrics["reward/remote/failed"],
                           "seconds": result.metrics["reward/remote/seconds"],
                           "score_sum": result.metrics["reward/remote/score_mean"] * len(flat_records)})
        out, start = [], 0
        for group_texts in texts:
            stop = start + len(group_texts)
            out.append((result.scores[start:stop], result.acc[start:stop].float(), group_texts))
            start = stop
        return out

    def remote_reward_metrics(self, counts: Counter | None = None, prefix: str = "reward/remote") -> dict[str, float]:
        """`reward/remote/{score_mean,failed,seconds}` since the last call (empty without `reward.remote`)."""
        counts = self.remote_counts if counts is None else counts
        if not counts["samples"]:
            return {}
        metrics = {f"{prefix}/score_mean": counts["score_sum"] / counts["samples"],
                   f"{prefix}/failed": float(counts["failed"]), f"{prefix}/seconds": float(counts["seconds"])}
        counts.clear()
        return metrics

    def hint_contexts(self, groups: list[ScoredGroup], prompts: list[list[int]], responses: list[list[int]]) -> Any:
        """CPO hinted prompts for every response, built through the chat template (see data/hints.py)."""
        records = [g.record for g in groups for _ in range(g.n)]
        hints, source_metrics = [None] * len(records), {}
        if self.config.algorithm.gold_as_hint:
            hints, source_metrics = self.hint_reader.read([r.extra_info for r in records],
                                                          [r.reward_model for r in records])
        contexts = build_hint_contexts(self.tokenizer, [r.messages for r in records], hints, prompts,
                                       HintConfig(max_prompt_length=self.config.data.max_prompt_length))
        contexts.source_metrics = source_metrics
        return contexts

    def validation_params(self, index: int) -> SamplingParams:
        """verl's `rollout.val_kwargs`: greedy unless `do_sample`, then `n` seeded samples per prompt."""
        val = self.config.actor_rollout_ref.rollout.val_kwargs
        if not val.do_sample:
            return self.sampling_params(None, n=val.n, greedy=True)
        return SamplingParams(n=val.n, temperature=val.temperature, top_p=val.top_p, top_k=val.top_k,
                              max_tokens=self.config.data.max_response_length,
                              stop_token_ids=(self.tokenizer.eos_token_id,), seed=self.config.trainer.seed + index)

    def validation_size(self) -> int:
        """How many rows of the validation set `validate` uses: all, or the first `data.val_max_samples`."""
        cap = self.config.data.val_max_samples
        return len(self.val_data) if cap == -1 else min(cap, len(self.val_data))

    def validate(self) -> dict[str, float]:
        """Accuracy on the held-out set, sampled as `rollout.val_kwargs` says (greedy by default): `val/acc` and
        `val/score` (means over every sample, i.e. mean@n), and the same per data source (`val/<source>/acc`)."""
        if self.val_data is None:
            return {}
        start = time.perf_counter()
        records = {}
        for index in range(self.validation_size()):
            record = self.val_data[index]
            records[f"val-{index}"] = record
            self.manager.submit(f"val-{index}", record.prompt_ids, self.validation_params(index))
        finished = {group.request_id: group for group in self.manager.completed(timeout=600)}
        items = [(records[rid], [sample.token_ids for sample in finished[rid].samples]) for rid in records]
        val_counts: Counter = Counter()
        scored = self.score_groups(items, val_counts)
        metrics = {"val/count": float(len(records)), **self.remote_reward_metrics(val_counts, "val/remote")}
        sources = [record.data_source for record, _ in items]
        for source in [None, *sorted(set(sources))]:
            chosen = [i for i, s in enumerate(sources) if source is None or s == source]
            prefix = "val" if source is None else f"val/{source}"
            metrics[f"{prefix}/acc"] = float(torch.cat([scored[i][1] for i in chosen]).mean())
            metrics[f"{prefix}/score"] = float(torch.cat([scored[i][0].float() for i in chosen]).mean())
        metrics["timing/val_s"] = time.perf_counter() - start
        return metrics

    def close(self) -> None:
        self.rewards.close()
        if self.owns_manager:
            self.manager.shutdown()
        else:
            self.manager.cancel_all()


def push_weights(actor_model: Any, side: RolloutSide | None) -> dict[str, float]:
    """Collective: stream the actor's weights (HF names, full tensors) from each stage's TP leader into the engines
    over the configured transport (rollout.weight_transport); returns sync time and this rank's bytes."""
    start = time.perf_counter()
    payload = [None, None]
    if side is not None:
        side.manager.begin_weight_sync()
        payload = [side.manager.sender_spec(), {k: os.environ[k] for k in RAY_AUTH_VARIABLES if k in os.environ}]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(payload, src=0)
    spec, ray_auth = payload
    if side is None:
        os.environ.update(ray_auth)  # a sending rank joins rank 0's Ray cluster with its authentication mode
    exports = parallel_state.get_data_parallel_rank() == 0
    tensors = iter_hf_weights(actor_model, actor_model.hf_config) if exports else iter(())
    sent = send_from_pipeline_stages(spec, tensors, parallel_state.get_pipeline_model_parallel_rank(),
                                     parallel_state.get_pipeline_model_parallel_world_size())
    if dist.get_world_size() > 1:
        dist.barrier()
    if side is not None:
        side.manager.finish_weight_sync()
    return {"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/bytes": float(sent.get("bytes", 0))}

