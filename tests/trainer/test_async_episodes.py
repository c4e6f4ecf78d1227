"""Agent episodes under asynchronous training (issue 36) at the controller: the real `EpisodeRunner` (its driver
thread, environment threads, the tiny model's chat template) and the real `RolloutController` with its staleness
admission, on engines with a real clock.

Why scripted engines: the property is about schedules (which turn is in flight at which push), over many of them,
in seconds; `TimedEngines` gives each request a random duration on the real clock and each token the weight version
in force when it was sampled, and a push does with the requests in flight what `async_training` says. The real
engines' side of that contract is tests/rollout/test_in_flight_push.py's, and the whole loop with episodes is
tests/trainer/test_multi_turn_e2e.py's."""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from megatron_cpo.config import build_config
from megatron_cpo.data.dataset import PromptRecord
from megatron_cpo.envs import EnvironmentRegistry, EpisodeRunner, MultiTurnConfig
from megatron_cpo.envs.templates import ChatTemplate
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.driver.admission import admission_for, staleness_metrics
from megatron_cpo.trainer.driver.controller import RolloutController
from megatron_cpo.trainer.driver.prompt_stream import PromptStream
from tests.envs.scripted import Counted
from tests.envs.test_episode_runner import EOS, TOKENIZER, ids

BATCH = 4


class TimedEngines:
    """`RolloutEngines` on the real clock, safe to call from two threads (see the module docstring). A request takes
    a random 0-`max_s` seconds; its 3 tokens are sampled at even times over it. `begin_weight_sync("finish")` waits
    for the requests in flight; the other policies let them go on, their later tokens under the new version. No
    request may be submitted between `begin_weight_sync` and `finish_weight_sync` (the runner is held)."""

    def __init__(self, seed: int, max_s: float = 0.06) -> None:
        self.rng, self.max_s = random.Random(seed), max_s
        self.changed = threading.Condition()
        self.running: dict[str, tuple[list[int], float, float]] = {}
        self.pushes = [(float("-inf"), 0)]
        self.weight_version, self.submitted, self.syncing = 0, 0, False
        self.engines, self.last_engine_failure, self.engine_restarts, self.rejoined = ["timed"], None, 0, ()

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        with self.changed:
            assert not self.syncing, f"{request_id} was submitted during a weight push"
            start = time.monotonic()
            self.running[request_id] = (list(prompt_token_ids), start, start + self.rng.uniform(0, self.max_s))
            self.submitted += 1
            self.changed.notify_all()

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while self.running:
                now = time.monotonic()
                done = [rid for rid, (_, _, end) in self.running.items() if end <= now]
                if done:
                    return [self._group(rid, *self.running.pop(rid)) for rid in done]
                if deadline is not None and now >= deadline:
                    raise TimeoutError("nothing finished yet")
                wait = min(end for _, _, end in self.running.values()) - now
                self.changed.wait(wait if deadline is None else min(wait, deadline - now))
            return []

    def cancel_all(self) -> int:
        with self.changed:
            dropped, self.running = len(self.running), {}
            return dropped

    def begin_weight_sync(self, in_flight: str) -> None:
        with self.changed:
            self.syncing = True
            if in_flight == "finish":  # they finish on the old weights before the reload
                time.sleep(max([0.0, *(end - time.monotonic() for _, _, end in self.running.values())]))

    def finish_weight_sync(self) -> None:
        with self.changed:
            self.weight_version += 1
            self.pushes.append((time.monotonic(), self.weight_version))
            self.syncing = False

    def _group(self, request_id: str, prompt: list[int], start: float, end: float) -> RolloutGroup:
        tokens = ids("a") + ids("b") + [EOS]
        times = [start + (i + 1) / len(tokens) * (end - start) for i in range(len(tokens))]
        versions = [max(v for t, v in self.pushes if t < when) for when in times]
        return RolloutGroup(request_id, prompt, [RolloutSample(tokens, [-0.5] * len(tokens), "stop", False,
                                                               policy_versions=versions)])


def rows(count: int) -> list[PromptRecord]:
    template = ChatTemplate(TOKENIZER)
    made = []
    for index in range(count):
        messages = [{"role": "user", "content": f"q{index}"}]
        made.append(PromptRecord(uid="", index=index, messages=messages,
                                 prompt_ids=template.prompt_ids(messages, None), data_source="megatron_cpo/arith",
                                 ground_truth="1"))
    return made


def half_right(items):
    """Sample i of a group scores i % 2 (the groups vary; the scores do not matter here)."""
    return [(torch.tensor([float(i % 2) for i in range(len(samples))]),) * 2 + ([""] * len(samples),)
            for _, samples in items]


@pytest.mark.parametrize("k, in_flight", [(1, "partial"), (2, "keep"), (1, "finish")])
def test_episodes_go_on_during_the_update_and_no_trained_token_is_older_than_k(k, in_flight):
    """Three-turn episodes (2 per prompt, 4 prompts a batch) under random request times and update times: episodes
    advance while the trainer updates (the next batch's turns are submitted meanwhile), some span a push, and every
    trained episode's oldest token is at most k versions behind the weights that train it; every environment made
    is closed once."""
    Counted.reset_counts()
    worst = spanning_turns = overlapped = 0
    for seed in range(3):
        engines = TimedEngines(seed)
        config = build_config({}, [f"data.train_batch_size={BATCH}", "actor_rollout_ref.rollout.n=2",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                                   f"async_training.max_staleness={k}"])
        multi_turn = MultiTurnConfig(enable=True, default_agent="tests.envs.scripted:CountedCountdown",
                                     agent_kwargs={"tests.envs.scripted:CountedCountdown": {"turns": 3}})
        runner = EpisodeRunner(engines, TOKENIZER, EnvironmentRegistry(multi_turn), 96, 256, poll_s=0.005)
        controller = RolloutController(runner, PromptStream(rows(200), 1, seed=seed), half_right,
                                       admission_for(config.async_training, BATCH), None,
                                       lambda s: SamplingParams(n=2, seed=s, max_tokens=8, stop_token_ids=(EOS,)),
                                       config.data, config.algorithm.filter_groups)
        update_s = random.Random(seed).uniform(0.02, 0.08)  # often shorter than an episode
        for step in range(1, 7):
            batch = controller.collect(step, engines.weight_version)
            assert batch.full and len(batch.groups) == BATCH
            for group in batch.groups:
                for versions, mask in zip(group.policy_versions.tolist(), group.loss_mask.tolist()):
                    sampled = [v for v, m in zip(versions, mask) if m]
                    assert batch.policy_version - min(sampled) <= k
                    worst = max(worst, batch.policy_version - min(sampled))
                    turns = [versions[i] for i in range(1, len(mask)) if mask[i] and not mask[i - 1]]
                    spanning_turns += len(set([versions[0], *turns])) > 1  # its turns began under two versions
            assert batch.metrics["async/staleness_max"] <= k
            before = engines.submitted
            time.sleep(update_s)  # the update: the engines and the episodes go on
            overlapped += engines.submitted > before
            with runner.held():
                engines.begin_weight_sync(in_flight)
                engines.finish_weight_sync()
        runner.close()
    assert overlapped > 0, "no turn was submitted while the trainer updated"
    assert worst >= 1 and spanning_turns > 0  # stale episodes, and episodes across a push, were trained
    deadline = time.monotonic() + 10
    while not Counted.closed_once() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Counted.closed_once() and Counted.made


def test_staleness_metrics_per_sample_and_per_sampled_token():
    """Hand-computed: an episode with turns under versions 3 and 4 and an observation between them (mask 0, version
    3), a sample all at version 5, an empty one; the trainer is at version 5."""
    versions = RaggedRows.from_lists([[3, 3, 3, 4, 4], [5, 5], []])
    sampled = RaggedRows.from_lists([[1, 1, 0, 1, 1], [1, 1], []])
    metrics = staleness_metrics(versions, 5, sampled)
    assert metrics == pytest.approx({
        "async/staleness_mean": 2 / 3, "async/staleness_max": 2.0, "async/partial_rollout_frac": 1 / 3,
        "async/pushes_spanned_mean": 1 / 3, "async/pushes_spanned_max": 1.0,
        "async/token_staleness_mean": (2 + 2 + 1 + 1 + 0 + 0) / 6})
    assert staleness_metrics(versions, 5)["async/token_staleness_mean"] == pytest.approx(8 / 7)  # all tokens count
