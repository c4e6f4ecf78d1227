"""`EpisodeRunner`: the group generator of multi-turn runs (rollout/generators.py's `GroupGenerator`).

Each of a group's `params.n` samples is an independent episode: every turn is one n=1 request to the engines (its
seed fixed by the group's seed, the sample and the turn), the sampled ids are appended as they came, the
environment's answer is turned into observation ids by the chat template (templates.py) and the episode is
resubmitted at once; episodes never wait for one another. The group is reported when its n episodes are done.

The episodes advance on the runner's own driver thread, whatever its caller does: the controller only takes the
groups that are done (`finished`). With asynchronous training (`async_training.max_staleness` > 0) the controller
is away in the update while episodes run, and they go on meanwhile (a turn finished during the update is stepped
and the next one submitted at once), so a long episode spans weight pushes: each of its tokens keeps the version
that sampled it (episode.py). A turn in flight at a push is one engine request and is treated as a single answer
is (`async_training.partial_rollout`, `in_flight_weight_updates`: it finishes on the old weights, or is aborted
and continued from its tokens so far, or stays paused in the engine); the environment is untouched by a push, so
an episode is never restarted and no turn is stepped twice. The driver is the only thread that uses the engines'
request book; the trainer's own engine calls (the weight push, the sync probe) run while it is `held`.

Environment calls (reset, step, the final score and close) run on `multi_turn.env_workers` threads with
`multi_turn.call_timeout_s` each (env_calls.py), so a slow or hung environment stalls neither the other episodes
nor the update. A step that raises becomes an error observation (`env_errors`); a step that times out ends its
episode (`env_timeout`: the environment's state is unknown, it is closed once the call returns); a reset that fails
leaves an empty episode (`reset_error`). Every environment made is closed once. A NaN or infinite step reward or
final score is refused where it arrives: scored 0 and described in the episode (`non_finite_rewards`, naming the
environment, the call, the turn and the row), for `reward.non_finite` to decide (rewards/non_finite.py).
`cancel_all` drops every episode in flight (the synchronous loop does at every step, a resumed run finds none): an
episode is regenerated from its start with a new environment, never half-trained.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any

from megatron_cpo.data.dataset import fit_prompt
from megatron_cpo.envs.base import Message, StepResult
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.env_calls import Call, EnvironmentCalls, as_step_result, finish_environment, make_and_reset
from megatron_cpo.envs.episode import Episode, turn_seed
from megatron_cpo.envs.registry import EnvironmentRegistry, agent_of
from megatron_cpo.envs.templates import ChatTemplate
from megatron_cpo.rewards.non_finite import source_row
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import RolloutGroup, SamplingParams

logger = logging.getLogger(__name__)

IDLE_POLL_S = 0.1  # the driver's longest wait on the engines: how long `held` and `cancel_all` may wait for it


@dataclass
class _Group:
    request_id: str
    record: Any
    params: SamplingParams
    episodes: list[Episode]
    left: int


class EpisodeRunner:
    """Runs each sample as an episode of its row's environment against `engines`; see the module docstring.

    `max_response_length` is the episode's budget (model and observation tokens); first prompts an environment
    builds itself are fitted to `max_prompt_length` by `truncation` (data.truncation's rule). `poll_s`: how long the
    driver waits on the engines while an environment call is out."""

    def __init__(self, engines: RolloutEngines, tokenizer: Any, registry: EnvironmentRegistry,
                 max_response_length: int, max_prompt_length: int, truncation: str = "error",
                 poll_s: float = 0.02) -> None:
        self.engines = engines
        self.template = ChatTemplate(tokenizer)
        self.registry = registry
        self.config: MultiTurnConfig = registry.config
        self.budget, self.max_prompt_length, self.truncation = max_response_length, max_prompt_length, truncation
        self.poll_s = poll_s
        self._changed = threading.Condition(threading.RLock())  # guards everything below; notified on progress
        self.calls = EnvironmentCalls(self.config.env_workers, self.config.call_timeout_s, self._notify)
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, Episode] = {}  # engine request id -> its episode
        self._ready: list[RolloutGroup] = []
        self._warned: set[str] = set()
        self._holds = 0
        self._driving = False  # the driver is between its checks (maybe inside an engine call)
        self._closing = False
        self._failure: BaseException | None = None
        self._last_progress = time.monotonic()
        self._driver = threading.Thread(target=self._drive, name="megatron-cpo-episodes", daemon=True)
        self._driver.start()

    # --- GroupGenerator ---------------------------------------------------------------------------------------
    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        """Start the `params.n` episodes of `record`; they start from the same state (reset gets the group's seed)."""
        with self._changed:
            if request_id in self._groups:
                raise ValueError(f"request {request_id!r} is already running")
            agent = agent_of(record, self.config.default_agent)
            make = self.registry.factory(agent)
            group = _Group(request_id, record, params, [], params.n)
            for index, seed in enumerate(params.sample_seeds()):
                episode = Episode(request_id, index, seed, self.budget, agent)
                group.episodes.append(episode)
                self.calls.start(episode, "reset", make_and_reset, make, record, params.seed or 0)
            self._groups[request_id] = group

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait until a group is done, then return every done group; [] when none is outstanding. TimeoutError when
        nothing moves (no turn, no environment call returns) for `timeout` seconds; the driver's failure, if any."""
        called = time.monotonic()
        with self._changed:
            while not self._ready:
                if self._failure is not None:
                    raise self._failure
                if not self._groups:
                    return []
                left = None if timeout is None else max(called, self._last_progress) + timeout - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(f"no episode advanced within {timeout}s: {len(self._turns)} turns on the "
                                       f"engines, {len(self.calls.out)} environment calls out")
                self._changed.wait(left)
            ready, self._ready = self._ready, []
        return ready

    def completed(self, timeout: float | None = None) -> Iterator[RolloutGroup]:
        while True:
            groups = self.finished(timeout)
            if not groups:
                return
            yield from groups

    @property
    def outstanding(self) -> int:
        """Groups submitted and not yet returned."""
        with self._changed:
            return len(self._groups) + len(self._ready)

    def cancel_all(self) -> int:
        """Drop every group in flight (their environments are closed once their calls return). A driver that failed
        (its failure was raised by `finished`, e.g. every engine lost) starts again with nothing in flight."""
        with self.held():
            with self._changed:
                if self._failure is not None and not self._closing:
                    self._failure = None
                    self._driver = threading.Thread(target=self._drive, name="megatron-cpo-episodes", daemon=True)
                    self._driver.start()
                dropped, on_engines = len(self._groups), bool(self._turns)
                busy = self.calls.drop_all()
                for group in self._groups.values():
                    for episode in group.episodes:
                        self.calls.release(episode, busy.get(id(episode)))
                self._groups.clear()
                self._turns.clear()
                self._ready.clear()
            if on_engines:  # the driver is held: no other thread uses the request book now
                self.engines.cancel_all()
        return dropped

    @contextmanager
    def held(self) -> Iterator[None]:
        """Inside this block no episode advances: the driver makes no engine call and submits no turn (the
        trainer pushes weights and probes the engines meanwhile). Environment calls already running go on, and
        turns already on the engines are the push's to handle (`async_training.partial_rollout`)."""
        with self._changed:
            self._holds += 1
            while self._driving:
                self._changed.wait()
        try:
            yield
        finally:
            with self._changed:
                self._holds -= 1
                self._changed.notify_all()

    def close(self) -> None:
        self.cancel_all()
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self._driver.join(timeout=10 * IDLE_POLL_S)
        self.calls.shutdown()
        self.registry.close()

    # --- the driver -------------------------------------------------------------------------------------------
    def _notify(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def _drive(self) -> None:
        """The driver thread: advance episodes until `close`; a failure is kept for `finished` to raise."""
        try:
            while self._drive_once():
                pass
        except BaseException as err:  # noqa: BLE001 - handed to the caller of `finished`
            with self._changed:
                self._failure, self._driving = err, False
                self._changed.notify_all()

    def _drive_once(self) -> bool:
        """Handle the environment calls that returned or timed out, else wait on the engines for finished turns
        (outside the lock: only this thread uses the request book); False once the runner closes."""
        with self._changed:
            while True:
                if self._closing:
                    return False
                due = [] if self._holds else self.calls.due(time.monotonic())
                if due or (self._turns and not self._holds):
                    break
                self._changed.wait(None if self._holds else self.calls.next_check(time.monotonic()))
            self._driving = True
            for future, call in due:
                self._handle_call(future, call)
            wait = None if due else (self.poll_s if self.calls.out else IDLE_POLL_S)
        groups = self._finished_turns(wait) if wait is not None else []
        with self._changed:
            for group in groups:
                episode = self._turns.pop(group.request_id, None)
                if episode is not None:
                    self._handle_turn(episode, group)
            self._driving = False
            if due or groups:
                self._last_progress = time.monotonic()
            if due or groups or self._holds:  # a group may be done; a hold may be waiting for the driver
                self._changed.notify_all()
        return True

    def _finished_turns(self, wait: float) -> list[RolloutGroup]:
        """Turns the engines finished within `wait` seconds ([] when none did)."""
        try:
            groups = self.engines.finished(timeout=wait)
        except TimeoutError:
            return []
        if not groups:
            raise RuntimeError(f"the engines hold none of the {len(self._turns)} turns this runner submitted")
        return groups

    def _handle_call(self, future: concurrent.futures.Future, call: Call) -> None:
        episode = call.episode
        if not future.done():
            self._warn(f"{call.kind}-timeout", f"an environment {call.kind} call of {episode.agent} took longer than "
                       f"multi_turn.call_timeout_s={self.config.call_timeout_s:g}s (counted in multi_turn/"
                       "env_timeouts)")
            episode.env_timeouts += 1
            episode.env_seconds += self.config.call_timeout_s
            self.calls.release(episode, future)
            if call.kind == "finish":
                self._complete(episode)
            else:
                self._end(episode, "reset_error" if call.kind == "reset" else "env_timeout", close=False)
            return
        try:
            value, seconds = future.result()
        except Exception as err:  # noqa: BLE001 - an environment's failure is data about the episode, not a crash
            episode.env_errors += 1
            self._warn(f"{call.kind}-{type(err).__name__}", f"environment {episode.agent} raised in {call.kind}: "
                       f"{type(err).__name__}: {err} (counted in multi_turn/env_errors)")
            self._on_call_error(episode, call.kind, err)
            return
        episode.env_seconds += seconds
        {"reset": self._on_reset, "step": self._on_step, "finish": self._on_finish}[call.kind](episode, value)

    def _on_call_error(self, episode: Episode, kind: str, err: Exception) -> None:
        if kind == "reset":
            self._end(episode, "reset_error", close=False)
        elif kind == "step":
            role = getattr(episode.env, "error_role", "user")
            self._on_step(episode, StepResult([{"role": role, "content": f"Error: {type(err).__name__}: {err}"}]))
        else:
            self._complete(episode)

    # --- an episode's stages ----------------------------------------------------------------------------------
    def _on_reset(self, episode: Episode, value: tuple[Any, list[Message]]) -> None:
        episode.env, episode.messages = value
        episode.tools = list(getattr(episode.env, "tool_schemas", None) or [])
        group = self._groups[episode.request_id]
        if episode.messages == [dict(role=m["role"], content=m["content"]) for m in group.record.messages] and \
                not episode.tools:
            episode.prompt_ids = list(group.record.prompt_ids)
        else:
            episode.prompt_ids = fit_prompt(self.template.prompt_ids(episode.messages, episode.tools),
                                            self.max_prompt_length, self.truncation,
                                            f"the first prompt of environment {episode.agent} for {episode.request_id}")
        self._submit_turn(episode)

    def _submit_turn(self, episode: Episode) -> None:
        group = self._groups[episode.request_id]
        max_tokens = episode.turn_tokens(self.config.max_tokens_per_turn)
        params = replace(group.params, n=1, max_tokens=max_tokens, seed=turn_seed(episode.seed,
                                                                                  episode.assistant_turns))
        request_id = episode.engine_request_id()
        self._turns[request_id] = episode
        self.engines.submit(request_id, episode.prompt_ids + episode.response_ids, params)

    def _handle_turn(self, episode: Episode, group: RolloutGroup) -> None:
        sample = group.samples[0]
        capped = episode.turn_tokens(self.config.max_tokens_per_turn) < episode.room
        episode.add_turn(list(sample.token_ids), list(sample.logprobs), sample.finish_reason, sample.policy_versions)
        content = self.template.decode(sample.token_ids)
        episode.messages.append({"role": "assistant", "content": content})
        if sample.finish_reason == "length":  # no turn after a truncated turn
            self._end(episode, "turn_length" if capped else "response_length")
            return
        episode.stop_text = self.template.decode(sample.token_ids[-1:], skip_special_tokens=False)
        self.calls.start(episode, "step", episode.env.step, content)

    def _on_step(self, episode: Episode, value: Any) -> None:
        try:
            result = as_step_result(value)
        except TypeError as err:
            episode.env_errors += 1
            self._warn(f"step-type-{episode.agent}", f"environment {episode.agent}: {err}")
            result = StepResult([{"role": "user", "content": f"Error: {err}"}])
        episode.turn_rewards.append(self._finite(episode, float(result.reward or 0.0), "step",
                                                 f"reward of turn {episode.assistant_turns}"))
        episode.tool_calls.update(result.info.get("tool_calls") or {})
        episode.tool_failures.update(result.info.get("tool_failures") or {})
        if result.done:
            self._end(episode, "done")
            return
        limit = self.config.turn_limit_reached(episode.assistant_turns, episode.user_turns)
        if limit is not None:
            self._end(episode, limit)
            return
        observation = self.template.observation(episode.messages, result.messages, episode.tools, episode.stop_text)
        if observation.history_rewritten:
            self._warn("history", "the chat template renders earlier turns differently once a message is appended; "
                       "observations are rendered after a fixed one-turn conversation (see the template check)")
        if len(observation.ids) >= episode.room:  # the next turn needs at least one token
            self._end(episode, "observation_length")
            return
        episode.add_observation(observation.ids, result.messages)
        self._submit_turn(episode)

    def _end(self, episode: Episode, reason: str, close: bool = True) -> None:
        """Stop the episode; its environment's final score (and close) is the last call."""
        episode.stop(reason)
        if close and episode.env is not None:
            self.calls.start(episode, "finish", finish_environment, episode.env)
            return
        self._complete(episode)

    def _on_finish(self, episode: Episode, score: float | None) -> None:
        episode.final_score = None if score is None else self._finite(episode, score, "score", "final score")
        self._complete(episode)

    def _finite(self, episode: Episode, value: float, call: str, what: str) -> float:
        """`value`, or 0 for a NaN or infinite one, which the episode records: the environment's method `call` that
        gave it, `what` it was, the episode and its row."""
        if math.isfinite(value):
            return value
        record = self._groups[episode.request_id].record
        episode.non_finite_rewards.append(
            f"environment {episode.agent!r} ({type(episode.env).__name__}.{call}) gave {value} as the {what} of "
            f"episode {episode.index} of {source_row(record.index, record.data_source)}")
        return 0.0

    def _complete(self, episode: Episode) -> None:
        group = self._groups[episode.request_id]
        if episode.final_score is None and self.registry.scores_itself(episode.agent):
            episode.final_score = 0.0  # its score() failed or was never reached: the step rewards are all it earned
        if not episode.prompt_ids:  # the reset failed: the row's own prompt, or a sibling episode's
            episode.prompt_ids = next((e.prompt_ids for e in group.episodes if e.prompt_ids),
                                      list(group.record.prompt_ids))
        group.left -= 1
        if group.left == 0:
            self._report(group)

    def _report(self, group: _Group) -> None:
        del self._groups[group.request_id]
        prompts = {tuple(episode.prompt_ids) for episode in group.episodes}
        if len(prompts) > 1:
            raise ValueError(f"environment {group.episodes[0].agent} started the episodes of {group.request_id} from "
                             "different conversations; reset(record, seed) must depend on the record and the seed only "
                             "(the episodes of a group are compared with one another)")
        samples = [episode.sample(self._exclude_from_loss(episode)) for episode in group.episodes]
        self._ready.append(RolloutGroup(group.request_id, list(group.episodes[0].prompt_ids), samples,
                                        finished_at=time.time()))

    def _exclude_from_loss(self, episode: Episode) -> bool:
        """The tokenization sanity check: compare the episode with the template's view of its conversation."""
        mode = self.config.check_mode
        if mode == "off" or not episode.response_ids:
            return False
        episode.template_check = self.template.check_conversation(
            episode.prompt_ids + episode.response_ids, episode.messages, episode.tools,
            ignore_whitespace=mode == "ignore_strippable")
        if episode.template_check == "differs":
            self._warn("template-check", f"an episode of {episode.agent} differs from the chat template's rendering "
                       f"of its conversation (tokenization_sanity_check_mode={mode}: "
                       f"{'excluded from the loss' if mode != 'warn' else 'trained as sampled'}; counted in "
                       "multi_turn/template_differs)")
        return episode.template_check == "differs" and mode != "warn"

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)

