"""`EpisodeRunner`: the group generator of multi-turn runs (rollout/generators.py's `GroupGenerator`).

Each of a group's `params.n` samples is an independent episode: every turn is one n=1 request to the engines (its
seed fixed by the group's seed, the sample and the turn), the sampled ids are appended as they came, the
environment's answer is turned into observation ids by the chat template (templates.py) and the episode is
resubmitted at once; episodes never wait for one another. The group is reported when its n episodes are done.

Environment calls (reset, step, the final score and close) run on `multi_turn.env_workers` threads with
`multi_turn.call_timeout_s` each; the runner advances episodes whenever the controller waits for groups
(`finished`), polling the engines briefly while an environment call is out. A step that raises becomes an error
observation (`env_errors`); a step that times out ends its episode (`env_timeout`: the environment's state is
unknown, it is closed once the call returns); a reset that fails leaves an empty episode (`reset_error`). Every
engine call is made on the caller's thread (the request books of the engines are not thread-safe). A NaN or infinite
step reward or final score is refused where it arrives: scored 0 and described in the episode (`non_finite_rewards`,
naming the environment, the call, the turn and the row), for `reward.non_finite` to decide (rewards/non_finite.py).
`cancel_all` drops every episode in flight: an episode is regenerated from its start, never half-trained.
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from megatron_cpo.data.dataset import fit_prompt
from megatron_cpo.envs.base import Message, StepResult
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.episode import Episode, turn_seed
from megatron_cpo.envs.registry import EnvironmentRegistry, agent_of
from megatron_cpo.envs.templates import ChatTemplate
from megatron_cpo.envs.threads import DaemonThreads
from megatron_cpo.rewards.non_finite import source_row
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import RolloutGroup, SamplingParams, derive_sample_seeds

logger = logging.getLogger(__name__)


@dataclass
class _Group:
    request_id: str
    record: Any
    params: SamplingParams
    episodes: list[Episode]
    left: int


@dataclass
class _Call:
    episode: Episode
    kind: str  # reset, step or finish


def _timed(function: Callable, *args: Any) -> tuple[Any, float]:
    started = time.perf_counter()
    return function(*args), time.perf_counter() - started


def as_step_result(value: Any) -> StepResult:
    """A `StepResult`, or Gym's (observation, reward, done, info) with a text or message-list observation."""
    if isinstance(value, StepResult):
        result = value
    elif isinstance(value, tuple) and len(value) == 4:
        result = StepResult(value[0], float(value[1] or 0.0), bool(value[2]), dict(value[3] or {}))
    else:
        raise TypeError(f"step returned {type(value).__name__}; return a StepResult or (observation, reward, done, "
                        "info)")
    if isinstance(result.messages, str):
        result.messages = [{"role": "user", "content": result.messages}] if result.messages else []
    if not all(isinstance(m, dict) and "role" in m and "content" in m for m in result.messages):
        raise TypeError(f"step's observation {result.messages!r} is not a list of {{role, content}} messages")
    return result


def _finish_environment(environment: Any) -> float | None:
    """The environment's final score, then close it (even when scoring fails)."""
    try:
        score = environment.score() if callable(getattr(environment, "score", None)) else None
        return None if score is None else float(score)
    finally:
        if callable(getattr(environment, "close", None)):
            environment.close()


class EpisodeRunner:
    """Runs each sample as an episode of its row's environment against `engines`; see the module docstring.

    `max_response_length` is the episode's budget (model and observation tokens); first prompts an environment
    builds itself are fitted to `max_prompt_length` by `truncation` (data.truncation's rule)."""

    def __init__(self, engines: RolloutEngines, tokenizer: Any, registry: EnvironmentRegistry,
                 max_response_length: int, max_prompt_length: int, truncation: str = "error",
                 poll_s: float = 0.02) -> None:
        self.engines = engines
        self.template = ChatTemplate(tokenizer)
        self.registry = registry
        self.config: MultiTurnConfig = registry.config
        self.budget, self.max_prompt_length, self.truncation = max_response_length, max_prompt_length, truncation
        self.poll_s = poll_s
        self.pool = DaemonThreads(self.config.env_workers, "megatron-cpo-env")
        self._groups: dict[str, _Group] = {}
        self._turns: dict[str, Episode] = {}  # engine request id -> its episode
        self._calls: dict[concurrent.futures.Future, _Call] = {}
        self._ready: list[RolloutGroup] = []
        self._warned: set[str] = set()

    # --- GroupGenerator ---------------------------------------------------------------------------------------
    def submit(self, request_id: str, record: Any, params: SamplingParams) -> None:
        """Start the `params.n` episodes of `record`; they start from the same state (reset gets the group's seed)."""
        if request_id in self._groups:
            raise ValueError(f"request {request_id!r} is already running")
        seeds = params.sample_seeds()
        agent = agent_of(record, self.config.default_agent)
        make = self.registry.factory(agent)
        group = _Group(request_id, record, params, [], params.n)
        for index, seed in enumerate(seeds):
            episode = Episode(request_id, index, seed, self.budget, agent)
            group.episodes.append(episode)
            self._call(episode, "reset", self._reset, make, record, params.seed or 0)
        self._groups[request_id] = group

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Advance episodes until a group is done, then return every done group; [] when none is outstanding.
        TimeoutError when nothing moves (no turn, no environment call returns) for `timeout` seconds."""
        last_progress = time.monotonic()
        while not self._ready:
            if not self._groups:
                return []
            if self._advance():
                last_progress = time.monotonic()
            elif timeout is not None and time.monotonic() - last_progress > timeout:
                raise TimeoutError(f"no episode advanced within {timeout}s: {len(self._turns)} turns on the engines, "
                                   f"{len(self._calls)} environment calls out")
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
        return len(self._groups) + len(self._ready)

    def cancel_all(self) -> int:
        """Drop every group in flight (their environments are closed once their calls return)."""
        dropped = len(self._groups)
        if self._turns:
            self.engines.cancel_all()
        busy = {id(call.episode): future for future, call in self._calls.items()}
        for group in self._groups.values():
            for episode in group.episodes:
                self._close_later(episode, busy.get(id(episode)))
        self._groups.clear()
        self._turns.clear()
        self._calls.clear()
        self._ready.clear()
        return dropped

    def close(self) -> None:
        self.cancel_all()
        self.pool.shutdown()
        self.registry.close()

    # --- the loop ---------------------------------------------------------------------------------------------
    def _advance(self) -> bool:
        """Handle what has finished (environment calls, timeouts, turns); True when something did."""
        now = time.monotonic()
        done = [future for future in self._calls if future.done() or self._late(future, now)]
        for future in done:
            self._handle_call(future, self._calls.pop(future))
        if done:
            return True
        if self._turns:
            wait = self.poll_s if self._calls else max(self.poll_s, 1.0)
            try:
                groups = self.engines.finished(timeout=wait)
            except TimeoutError:
                return False
            if not groups:
                raise RuntimeError(f"the engines hold none of the {len(self._turns)} turns this runner submitted")
            for group in groups:
                episode = self._turns.pop(group.request_id, None)
                if episode is not None:
                    self._handle_turn(episode, group)
            return True
        if self._calls:
            running = [future.started for future in self._calls if future.started is not None]
            wait = min(running) + self.config.call_timeout_s - now if running else self.config.call_timeout_s
            concurrent.futures.wait(list(self._calls), timeout=max(0.0, wait) + 1e-3,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        return False

    def _late(self, future: concurrent.futures.Future, now: float) -> bool:
        """A call past its timeout (counted from when it started running)."""
        return future.started is not None and now - future.started > self.config.call_timeout_s

    def _call(self, episode: Episode, kind: str, function: Callable, *args: Any) -> None:
        self._calls[self.pool.submit(_timed, function, *args)] = _Call(episode, kind)

    def _handle_call(self, future: concurrent.futures.Future, call: _Call) -> None:
        episode = call.episode
        if episode.request_id not in self._groups:
            return
        if not future.done():
            self._warn(f"{call.kind}-timeout", f"an environment {call.kind} call of {episode.agent} took longer than "
                       f"multi_turn.call_timeout_s={self.config.call_timeout_s:g}s (counted in multi_turn/"
                       "env_timeouts)")
            episode.env_timeouts += 1
            episode.env_seconds += self.config.call_timeout_s
            self._close_later(episode, future)
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
    def _reset(self, make: Callable[[], Any], record: Any, seed: int) -> tuple[Any, list[Message]]:
        environment = make()
        messages = environment.reset(record, seed)
        return environment, [dict(message) for message in messages]

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
        episode.add_turn(list(sample.token_ids), list(sample.logprobs), sample.finish_reason)
        content = self.template.decode(sample.token_ids)
        episode.messages.append({"role": "assistant", "content": content})
        if sample.finish_reason == "length":  # no turn after a truncated turn
            self._end(episode, "turn_length" if capped else "response_length")
            return
        episode.stop_text = self.template.decode(sample.token_ids[-1:], skip_special_tokens=False)
        self._call(episode, "step", episode.env.step, content)

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
            self._call(episode, "finish", _finish_environment, episode.env)
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
        self._ready.append(RolloutGroup(group.request_id, list(group.episodes[0].prompt_ids), samples))

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

    def _close_later(self, episode: Episode, busy: concurrent.futures.Future | None) -> None:
        """Close an abandoned episode's environment now, or once its running call returns."""
        environment = episode.env
        if busy is not None and environment is None:  # its reset is running: close what the reset returns
            busy.add_done_callback(lambda f: not f.cancelled() and f.exception() is None
                                   and self._close_quietly(f.result()[0][0]))
        elif environment is not None:
            if busy is None:
                self._close_quietly(environment)
            else:
                busy.add_done_callback(lambda _: self._close_quietly(environment))

    def _close_quietly(self, environment: Any) -> None:
        try:
            self.pool.submit(_quiet_close, environment)
        except RuntimeError:  # the pool was shut down (the run is closing): close on this thread
            _quiet_close(environment)

    def _warn(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("%s", message)


def _quiet_close(environment: Any) -> None:
    try:
        if callable(getattr(environment, "close", None)):
            environment.close()
    except Exception as err:  # noqa: BLE001 - closing an abandoned episode must not disturb the run
        logger.debug("closing an abandoned environment failed: %s", err)
