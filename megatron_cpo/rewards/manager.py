"""Reward manager: scores a batch of responses in a grading pool and turns scores into sparse token rewards.

A sample whose grader raises, hangs past ``timeout_s`` or kills its worker gets that grader's wrong-answer
score (``Grader.failure_score``), its reason is kept in ``details`` and it is counted in the metrics; training never
stops for it. With a remote reward model (``reward.remote``, see ``remote.py``) its score replaces or is added to the
rule score of every sample; ``acc`` stays the rule graders'. A non-finite score, the graders' or the reward model's,
is refused here (scored 0 and described in ``RewardResult.non_finite``; ``reward.non_finite`` decides what follows,
non_finite.py). Following the seed (section 2.2), the whole sequence reward sits on the last valid response token.
"""
from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_cpo.algorithms.overlong import OverlongBufferConfig
from megatron_cpo.config_checks import check_choice
from megatron_cpo.rewards.non_finite import NON_FINITE_POLICIES, screen_scores, source_row
from megatron_cpo.rewards.pool import GraderPool, TaskOutcome
from megatron_cpo.rewards.registry import get_grader, load_callable, missing_graders
from megatron_cpo.rewards.sandbox import SandboxConfig, configure_sandbox, sandbox_metrics
from megatron_cpo.rewards.remote import RemoteRewardConfig, RemoteRewardModel


@dataclass
class RewardConfig:
    """`reward.*`: the grading process pool, what grades each response, the code sandbox, a remote reward model and
    DAPO's overlong buffer (applied by the trainer's group selection).

    num_workers: grading processes (the pool is bounded; keep it at or below the free cores).
    timeout_s: hard wall-time limit per sample; past it the worker is killed and replaced (code graders need their
        total_timeout_s plus process start-up).
    custom_reward_function: "pkg.module:function" or "file.py:function" that grades every response instead of the
        grader registered for its data source; it takes `data_source, solution_str, ground_truth, extra_info`
        keywords and returns a score or a dict with `score` and `acc`. A bare "file.py" grades with its function
        `custom_reward_function_name`. verl's top-level `custom_reward_function.path` / `.name` are accepted for
        these two keys. `reward_function` is the resulting "module:function" ("" when unset).
    custom_graders: `{data_source: "pkg.module:fn"}` adds or replaces the grader of single sources, in the trainer
        (data check) and in every grading worker.
    custom_failure_score: score given when a custom grader fails.
    grader_kwargs: `{data_source: {kwarg: value}}` passed to that source's grader over its defaults, e.g.
        `{math500: {wrong_score: 0.0}}` for 1/0 math rewards or `{apps: {continuous: false}}`.
    worker_memory_limit_mb: address-space limit of each grading process (a grader that exceeds it fails with
        MemoryError instead of exhausting the host); 0 for no limit.
    sandbox: which backend runs model-written code (`SandboxConfig`, rewards/sandbox.py); batches with code samples
        log `reward/sandbox_weak`.
    remote (`reward.remote.*`): a reward model served over HTTP whose score replaces or is added to the rule score.
    non_finite: what a NaN or infinite score does, from any source (a grader, the custom reward function, the remote
        reward model, an environment's step reward or final score): `error` (default) stops the run before the
        update with one line naming the source, the function and the row, nothing of that step trained; `zero`
        trains it as 0 and counts it in `reward/non_finite` (an environment's also in
        `multi_turn/non_finite_rewards`). Validation scores are never trained: there a non-finite score is always
        0, counted in `val/non_finite`.
    """

    num_workers: int = 2
    timeout_s: float = 10.0
    custom_reward_function: str = ""
    custom_reward_function_name: str = "compute_score"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    custom_graders: dict[str, str] = field(default_factory=dict)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    custom_failure_score: float = 0.0
    grader_kwargs: dict[str, dict] = field(default_factory=dict)
    worker_memory_limit_mb: int = 4096
    non_finite: str = "error"

    def __post_init__(self) -> None:
        check_choice("reward.non_finite", self.non_finite, NON_FINITE_POLICIES)
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0 (seconds; code graders need their "
                             "total_timeout_s plus process start-up)")
        if self.worker_memory_limit_mb and self.worker_memory_limit_mb < 512:
            raise ValueError(f"reward.worker_memory_limit_mb={self.worker_memory_limit_mb} cannot hold sympy and the "
                             "graders; use >= 512, or 0 for no limit")
        function, name = self.custom_reward_function, self.custom_reward_function_name
        if function and not function.endswith(".py") and name != "compute_score":
            raise ValueError(f"reward.custom_reward_function={function!r} names its function, but "
                             f"reward.custom_reward_function_name (verl: custom_reward_function.name)={name!r} names "
                             "another; give the .py file alone (verl: custom_reward_function.path) or drop the name")
        if function.endswith(".py") and not name:
            raise ValueError(f"custom_reward_function.name is empty; name the function in {function!r} that computes "
                             "the score (verl: compute_score)")
        for source, path in self.custom_graders.items():
            if not (isinstance(path, str) and ":" in path):
                raise ValueError(f"reward.custom_graders[{source!r}]={path!r} must be 'pkg.module:function' or "
                                 "'file.py:function'")
        for source, kwargs in self.grader_kwargs.items():
            if not isinstance(kwargs, dict):
                raise ValueError(f"reward.grader_kwargs[{source!r}]={kwargs!r} must be a mapping of the grader's "
                                 "keyword arguments, e.g. {wrong_score: 0.0}")

    @property
    def reward_function(self) -> str:
        """The function that grades every response ("pkg.module:fn" or "file.py:fn"), "" when the grader of each
        response's data source grades it."""
        if self.custom_reward_function.endswith(".py"):
            return f"{self.custom_reward_function}:{self.custom_reward_function_name}"
        return self.custom_reward_function

    @property
    def needs_ground_truth(self) -> bool:
        """Whether every data row needs a `reward_model.ground_truth`: the grader of its data source compares each
        response with it; one `reward_function` for every response may not read it (verl's reward-model data)."""
        return not self.reward_function

    def sources_without_grader(self, data_sources: Iterable[str]) -> list[str]:
        """The distinct sources among `data_sources` that nothing grades, sorted: none with a `reward_function`,
        else those with neither a `custom_graders` entry nor a registered grader."""
        if self.reward_function:
            return []
        return missing_graders(source for source in data_sources if source not in self.custom_graders)


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
        for path in [*config.custom_graders.values(), config.reward_function]:
            if path:
                load_callable(path)  # a missing module or function fails here, naming it, before any worker starts
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
