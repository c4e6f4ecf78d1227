"""The trainer's side of the sync check (rollout/sync_check.py): after a weight push, are the engines serving it?

`SyncProbe.after_push` is collective, like the step's log-probs: rank 0 reads the engines' reload reports (a
parameter nothing filled, a tensor sent twice) and, when the push is due for the probe, has every live engine
continue the fixed probe prompts greedily (`RolloutEngines.sync_probe`) while the requests the push paused still
wait (asynchronous training: vLLM's CPU kernels are not batch-invariant, and the probe beside them measured 1.3e-4
on engines in sync), then lets them go on (`RolloutEngines.resume_generation`). It broadcasts both; every rank
scores the engines' tokens with the actor (`MegatronPolicy.log_probs`: TP/PP/DP aware, the same on every rank
afterwards) and every rank reaches the same verdict. Over the tolerance the push is reported as
`EngineOutOfSyncError`, one line naming the push and the difference; the loop logs the step, checkpoints and stops.
When the actor's own log-prob of a probe token is NaN or infinite the fault is the trainer's weights, not the sync:
that is `TrainerNotFiniteError`, and the loop stops without a checkpoint (none may hold such weights).

Rank 0 also watches each step's own engine-vs-trainer metrics for a push gone wrong (`driver/mismatch_watch.py`).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from megatron_cpo.config_checks import ConfigError
from megatron_cpo.data.dataset import encode_texts, render_prompts
from megatron_cpo.rollout import RolloutEnginesLostError
from megatron_cpo.rollout.config import SyncCheckConfig
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.sync_check import compare_probe
from megatron_cpo.rollout.weight_sync import reload_problem
from megatron_cpo.trainer.batch.sequences import pack_sequences
from megatron_cpo.trainer.collectives import broadcast_object

logger = logging.getLogger(__name__)


class EngineOutOfSyncError(RuntimeError):
    """A push left the engines serving other weights than the trainer's (one line, naming the push); `metrics`:
    the check's metrics when the probe ran."""

    def __init__(self, message: str, metrics: dict[str, float] | None = None) -> None:
        super().__init__(message)
        self.metrics = metrics or {}


class TrainerNotFiniteError(EngineOutOfSyncError):
    """The sync probe found the trainer's own log-probs NaN or infinite: its weights are not finite, the engines
    serve what they were sent (one line, naming the push and the probe token)."""


class SyncProbe:
    """Checks pushes on every rank (`after_push`)."""

    def __init__(self, settings: SyncCheckConfig, dtype: str, max_model_len: int, tokenizer: Any, pad_token_id: int
                 ) -> None:
        """`settings`: `rollout.sync_check`; `dtype`: the actor's (`megatron.params_dtype`, `auto` resolved), which sets
        the default tolerance; `max_model_len`: the engines' (`data.max_prompt_length + data.max_response_length`)."""
        self.settings = settings
        self.dtype = dtype
        self.tolerance = self.settings.tolerance_for(self.dtype)
        self.pad_token_id = pad_token_id
        texts = [text for text in self.settings.prompts if text.strip()]
        if getattr(tokenizer, "chat_template", None):
            texts = render_prompts(tokenizer, [[{"role": "user", "content": text}] for text in texts])
        self.prompts = [ids for ids in encode_texts(tokenizer, texts) if ids]
        longest = max((len(ids) for ids in self.prompts), default=0)
        limit = max_model_len
        if self.settings.enable and longest + self.settings.max_tokens > limit:
            raise ConfigError(f"the longest sync-check probe prompt has {longest} tokens; with actor_rollout_ref."
                             f"rollout.sync_check.max_tokens={self.settings.max_tokens} it exceeds the engines' "
                             f"{limit} tokens (data.max_prompt_length + data.max_response_length); shorten "
                             "actor_rollout_ref.rollout.sync_check.prompts or max_tokens")
        self.pushes = 0

    def holds_paused_requests(self, in_flight: str) -> bool:
        """Whether the next push, made with `in_flight` (types.IN_FLIGHT_POLICIES), is to leave the requests it
        pauses paused until `after_push` has probed the engines (`RolloutEngines.finish_weight_sync(resume=False)`);
        a synchronous push (`none`) pauses nothing."""
        return in_flight != "none" and self.settings.due(self.pushes)

    def after_push(self, step: int, actor: Any, manager: RolloutEngines | None, reports: dict | None,
                   held: bool = False) -> dict[str, float]:
        """Collective, right after a push of the weights of step `step` (the start step for the push before
        training). `manager`/`reports`: rank 0's engines and their reload reports (None elsewhere); `held`: the push
        left paused requests paused (`holds_paused_requests`), rank 0 resumes them once the probe has run, whatever
        it found. Returns the check's metrics ({} when not due); raises `EngineOutOfSyncError` on every rank when
        the push is wrong."""
        push, self.pushes = self.pushes, self.pushes + 1
        if not self.settings.enable:
            return {}
        started = time.perf_counter()
        payload = None
        if manager is not None:
            try:
                payload = (reload_problem(reports or {}),
                           self._probe(manager) if self.settings.due(push) else [])
            finally:
                if held:
                    _resume(manager)
        problem, rows = broadcast_object(payload)
        where = _push_name(step, push)
        if problem is not None:
            raise EngineOutOfSyncError(f"the {where}: {problem}")
        if not rows:
            return {}
        labels, prompts, responses, engine_log_probs = map(list, zip(*rows))
        seqs = pack_sequences(prompts, responses, self.pad_token_id, self.settings.max_tokens)
        trainer_log_probs, _ = actor.log_probs(seqs, 1.0)
        gap = compare_probe(labels, engine_log_probs, trainer_log_probs)
        metrics = {**gap.metrics(), "timing/sync_check_s": time.perf_counter() - started}
        if gap.trainer_non_finite is not None:
            raise TrainerNotFiniteError(
                f"the trainer's own weights are not finite at the {where}: the actor's log-prob of a sync-probe token "
                f"is {gap.trainer_non_finite}; the engines were sent these weights, so this is not an engine that "
                "serves other weights", metrics)
        if not gap.max_abs_diff <= self.tolerance:
            raise EngineOutOfSyncError(
                f"the engines do not serve the trainer's weights after the {where}: the largest |engine - trainer| "
                f"log-prob difference on the sync probe is {gap.max_abs_diff:.6g} ({gap.worst}), above the "
                f"tolerance {self.tolerance:g} for {self.dtype} (actor_rollout_ref.rollout.sync_check.tolerance)",
                metrics)
        logger.log(logging.INFO if push == 0 else logging.DEBUG, "sync check of the %s: engines and trainer agree "
                   "(max |engine - trainer| log-prob difference %.3g, tolerance %g)", where, gap.max_abs_diff,
                   self.tolerance)
        return metrics

    def _probe(self, manager: RolloutEngines) -> list[tuple[str, list[int], list[int], list[float]]]:
        """Rank 0: (label, prompt, greedy tokens, engine log-probs) per live engine and probe prompt; [] when the
        engines died meanwhile (the next rollout reports that)."""
        try:
            groups = manager.sync_probe(self.prompts, self.settings.max_tokens)
        except RolloutEnginesLostError:
            return []
        return [(group.request_id, group.prompt_token_ids, group.samples[0].token_ids, group.samples[0].logprobs)
                for group in groups]


def _resume(manager: RolloutEngines) -> None:
    """Rank 0: let the requests paused for the probe go on; nothing to do when every engine died meanwhile (the
    next rollout reports that)."""
    try:
        manager.resume_generation()
    except RolloutEnginesLostError:
        pass


def _push_name(step: int, push: int) -> str:
    return f"weight push before training (step {step})" if push == 0 else f"weight push of step {step}"


def sync_check_metrics(push_metrics: dict[str, float]) -> dict[str, float]:
    """The sync check's metrics among a push's (they go to the row of the step whose weights were pushed)."""
    return {k: v for k, v in push_metrics.items() if k.startswith(("rollout/sync_check", "timing/sync_check"))}
