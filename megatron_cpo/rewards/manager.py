"""Reward manager: scores a batch of responses in a grading pool and turns scores into sparse token rewards.

A grader that raises, hangs or crashes gives its wrong-answer score and is counted, never stopping training; a remote
reward model's score replaces or adds to the rule score; non-finite scores are refused here (non_finite.py). The
sequence reward sits on the last valid response token (the seed's section 2.2).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards.config import RewardConfig
from megatron_cpo.rewards.non_finite import screen_scores, source_row
from megatron_cpo.rewards.pool import GraderPool, TaskOutcome
from megatron_cpo.rewards.registry import get_grader
from megatron_cpo.rewards.remote import RemoteRewardModel
from megatron_cpo.rewards.sandbox import configure_sandbox, sandbox_metrics


@dataclass
class RewardResult:
    """Per-sample ``scores`` [N] and ``acc`` [N], grader ``details`` (pred, reason, status) and batch ``metrics``;
    ``non_finite``: {sample index: what it was} for each non-finite score refused (scored 0 here)."""

    scores: torch.Tensor
    acc: torch.Tensor
    details: list[dict]
    metrics: dict[str, float]
    non_finite: dict[int, str] = field(default_factory=dict)


def token_level_rewards(scores: torch.Tensor, response_lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """Write ``scores[i]`` at position ``response_lengths[i] - 1`` of row ``i`` of a zero [N, max_len] tensor."""
    if scores.dim() != 1 or response_lengths.shape != scores.shape:
        raise ValueError(f"scores {tuple(scores.shape)} and response_lengths {tuple(response_lengths.shape)} must "
                         "both be 1-D of the same length")
    bad = (response_lengths < 1) | (response_lengths > max_len)
    if bad.any():
        index = int(bad.nonzero()[0, 0])
        raise ValueError(f"response_lengths[{index}]={int(response_lengths[index])} is outside [1, {max_len}]; "
                         "every response needs at least one valid token (its EOS) and at most max_len")
    rewards = torch.zeros(scores.shape[0], max_len, dtype=scores.dtype, device=scores.device)
    return rewards.scatter_(1, (response_lengths.long() - 1).unsqueeze(1), scores.unsqueeze(1))


def _group_metrics(prefix: str, scores: torch.Tensor, acc: torch.Tensor, timeouts: torch.Tensor,
                   errors: torch.Tensor) -> dict[str, float]:
    return {
        f"{prefix}/score_mean": scores.mean().item(),
        f"{prefix}/score_std": scores.std(unbiased=False).item(),
        f"{prefix}/acc": acc.float().mean().item(),
        f"{prefix}/count": float(scores.numel()),
        f"{prefix}/timeouts": timeouts.sum().item(),
        f"{prefix}/errors": errors.sum().item(),
    }


def reward_metrics(scores: torch.Tensor, acc: torch.Tensor, statuses: list[str], sources: list[str],
                   grader_names: list[str]) -> dict[str, float]:
    """Mean/std/acc/timeouts/errors overall, per data source and per grader."""
    timeouts = torch.tensor([status == "timeout" for status in statuses])
    errors = torch.tensor([status in ("error", "crashed") for status in statuses])
    metrics = _group_metrics("reward", scores, acc, timeouts, errors)
    for kind, keys in (("source", sources), ("grader", grader_names)):
        for key in sorted(set(keys)):
            mask = torch.tensor([k == key for k in keys])
            metrics.update(_group_metrics(f"reward/{kind}/{key}", scores[mask], acc[mask], timeouts[mask],
                                          errors[mask]))
    return metrics


class RewardManager:
    """Owns a ``GraderPool``; ``score`` grades a batch. Use as a context manager or call ``close``."""

    def __init__(self, config: RewardConfig) -> None:
        self.config = config
        # a missing module or function fails here, naming it, before any worker starts
        for source, path in config.custom_graders.items():
            import_callable(path, f"reward.custom_graders[{source!r}]")
        if config.reward_function:
            import_callable(config.reward_function, "reward.custom_reward_function")
        self._pool = GraderPool(config.num_workers, dict(config.custom_graders), config.reward_function or None,
                                dict(config.grader_kwargs), config.worker_memory_limit_mb or None, config.sandbox)
        configure_sandbox(config.sandbox, resolve=False)  # this process resolves it too, for the log and metric
        self.remote = RemoteRewardModel(config.remote) if config.remote.enable else None

    def _grader_for(self, data_source: str) -> tuple[str, float]:
        """(grader name, failure score); unknown sources fail here, before any work is done."""
        if self.config.reward_function:
            return self.config.reward_function, self.config.custom_failure_score
        if data_source in self.config.custom_graders:
            return self.config.custom_graders[data_source], self.config.custom_failure_score
        grader = get_grader(data_source)
        return grader.name, grader.failure_score

    def _grader_kind(self, name: str) -> str:
        """How a refusal names the function that graded: the custom reward function, a custom grader or a grader."""
        if name == self.config.reward_function:
            return "the custom reward function"
        return "the custom grader" if name in self.config.custom_graders.values() else "the grader"

    def score(self, data_sources: list[str], solution_strs: list[str], ground_truths: list,
              extra_infos: list | None = None, prompts: list[str] | None = None,
              rows: list | None = None) -> RewardResult:
        """Grade N responses; returns scores, acc, per-sample details and metrics (see ``RewardResult``).
        ``prompts`` (the prompt text of each response) is what a remote reward model reads; "" when not given.
        ``rows``: each response's row index in its data file, which a refused non-finite score is named by (default:
        its position in this batch)."""
        count = len(solution_strs)
        extra_infos = extra_infos if extra_infos is not None else [None] * count
        prompts = prompts if prompts is not None else [""] * count
        rows = rows if rows is not None else list(range(count))
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == len(prompts) == count):
            raise ValueError(f"batch fields differ in length: data_sources={len(data_sources)}, solution_strs="
                             f"{count}, ground_truths={len(ground_truths)}, extra_infos={len(extra_infos)}, "
                             f"prompts={len(prompts)}")
        if count == 0:
            empty = torch.zeros(0)
            return RewardResult(scores=empty, acc=empty.bool(), details=[], metrics={})
        graders = [self._grader_for(source) for source in data_sources]
        started = time.monotonic()
        outcomes: list[TaskOutcome] = self._pool.run(
            list(zip(data_sources, solution_strs, ground_truths, extra_infos)), self.config.timeout_s)
        details = []
        for outcome, (name, failure_score) in zip(outcomes, graders):
            if outcome.status == "ok":
                detail = dict(outcome.result)
            else:
                detail = {"score": failure_score, "acc": False, "pred": None, "reason": outcome.message}
            detail.update(status=outcome.status, grader=name, seconds=outcome.seconds)
            details.append(detail)
        scores, refused = screen_scores(
            torch.tensor([detail["score"] for detail in details], dtype=torch.float32),
            lambda i, value: f"{self._grader_kind(graders[i][0])} {graders[i][0]} gave {value} for "
                             f"{source_row(rows[i], data_sources[i])}")
        acc = torch.tensor([bool(detail["acc"]) for detail in details], dtype=torch.bool)
        remote_metrics = {}
        if self.remote is not None:
            scores, remote_metrics, remote_refused = self._remote_scores(
                scores, details, prompts, solution_strs, data_sources, ground_truths, extra_infos, rows)
            # the rule graders' own score is not trained when the model's replaces it (their `acc` still counts)
            refused = remote_refused if self.remote.config.combine == "replace" else {**remote_refused, **refused}
        for index, description in refused.items():
            details[index]["non_finite"] = description
        metrics = reward_metrics(scores, acc, [d["status"] for d in details], list(data_sources),
                                 [name for name, _ in graders])
        metrics.update(remote_metrics)
        metrics["reward/non_finite"] = float(len(refused))
        metrics["reward/grading_seconds"] = time.monotonic() - started
        metrics["reward/worker_restarts"] = float(self._pool.restarts)
        if any(name == "compute_code_score" for name, _ in graders):
            metrics.update(sandbox_metrics())
        return RewardResult(scores=scores, acc=acc, details=details, metrics=metrics, non_finite=refused)

    def _remote_scores(self, rule_scores: torch.Tensor, details: list[dict], prompts: list[str],
                       solution_strs: list[str], data_sources: list[str], ground_truths: list, extra_infos: list,
                       rows: list) -> tuple[torch.Tensor, dict[str, float], dict[int, str]]:
        """The remote model's scores combined with the rule scores (``remote.combine``), ``reward/remote/*``, and
        the model's non-finite scores refused (scored 0)."""
        started = time.monotonic()
        extra = [{"data_source": source, "ground_truth": truth, "extra_info": info}
                 for source, truth, info in zip(data_sources, ground_truths, extra_infos)]
        remote = self.remote.score_batch(prompts, solution_strs, extra)
        for detail, rule_score, model_score, failed in zip(details, rule_scores.tolist(), remote.scores.tolist(),
                                                           remote.failed.tolist()):
            detail.update(rule_score=rule_score, remote_score=model_score, remote_failed=failed)
            if failed:
                detail["remote_error"] = remote.error
        model_scores, refused = screen_scores(
            remote.scores, lambda i, value: f"the reward model at {self.remote.endpoint} gave {value} for "
                                            f"{source_row(rows[i], data_sources[i])}")
        combined = model_scores if self.remote.config.combine == "replace" else rule_scores + model_scores
        return combined, {"reward/remote/score_mean": model_scores.mean().item(),
                          "reward/remote/failed": remote.failed.sum().item(),
                          "reward/remote/seconds": time.monotonic() - started}, refused

    def close(self) -> None:
        """Stop the grading processes."""
        self._pool.close()

    def __enter__(self) -> RewardManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
