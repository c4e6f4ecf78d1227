"""Asynchronous training's admission and commit rules (trainer/driver/admission.py, trainer/driver/controller.py) on
a scripted engine.

Why a scripted engine: these properties are about schedules, so the test must choose them: which request finishes
when, relative to the others and to the weight pushes, over thousands of random orders. A real engine cannot be
told to finish request 7 before request 3, or to be mid-way through a response at a push. `ScriptedEngines`
implements `RolloutEngines` with a virtual clock: each request takes a random time, its tokens are a fixed function
of its prompt and seed (so two schedules can be compared token for token), each token carries the weight version in
force when it was sampled, and a push does with requests in flight what `async_training` says (finish them first,
or continue them on the new weights). The real engines' side of the same contract (greedy samples unchanged by a
push, per-token versions) is tested in tests/rollout/test_in_flight_push.py, and the whole loop in test_async_e2e.py.
"""
from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
import torch

from megatron_cpo.config import build_config
from megatron_cpo.rollout.generators import SingleTurnGenerator
from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams
from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
from megatron_cpo.trainer.driver.admission import StalenessAdmission, admission_for
from megatron_cpo.trainer.driver.controller import RolloutController
from megatron_cpo.trainer.driver.prompt_stream import PromptStream

BATCH = 4


@dataclass
class _Running:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    start: float
    end: float


@dataclass
class ScriptedEngines:
    """`RolloutEngines` on a virtual clock (see the module docstring). `pushes`: (time, version) of each push."""
    seed: int
    engines: list = field(default_factory=lambda: ["scripted"])
    last_engine_failure: str | None = None
    weight_version: int = 0
    now: float = 0.0
    running: dict = field(default_factory=dict)
    pushes: list = field(default_factory=lambda: [(float("-inf"), 0)])
    most_running: int = 0

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def submit(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        duration = self.rng.uniform(0.05, 3.0) * (8.0 if self.rng.random() < 0.1 else 1.0)  # a long tail
        self.running[request_id] = _Running(request_id, list(prompt_token_ids), params, self.now, self.now + duration)
        self.most_running = max(self.most_running, len(self.running))

    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        if not self.running:
            return []
        if timeout == 0 and min(r.end for r in self.running.values()) > self.now:
            raise TimeoutError("nothing finished yet")
        self.now = max(self.now, min(r.end for r in self.running.values()))
        done = sorted((r for r in self.running.values() if r.end <= self.now), key=lambda r: r.end)
        for request in done:
            del self.running[request.request_id]
        return [self._group(request) for request in done]

    def completed(self, timeout: float | None = None):
        while self.running:
            yield from self.finished(timeout)

    def cancel_all(self) -> int:
        dropped, self.running = len(self.running), {}
        return dropped

    def advance(self, seconds: float) -> None:
        """The trainer updates for `seconds`; the engines generate meanwhile."""
        self.now += seconds

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        if in_flight == "none":
            assert not self.running, "a synchronous push with requests in flight"
        elif in_flight == "finish":  # they finish on the old weights; the push waits for them
            self.now = max([self.now, *(r.end for r in self.running.values())])

    def finish_weight_sync(self) -> None:
        self.weight_version += 1
        self.pushes.append((self.now, self.weight_version))

    def sync_weights(self, named_tensors, transport=None, in_flight: str = "none") -> dict[str, float]:
        self.begin_weight_sync(in_flight)
        self.finish_weight_sync()
        return {}

    def sender_spec(self, transport=None):
        return None  # nothing to send to: the scripted engine has no weights

    def health(self) -> list[bool]:
        return [True]

    def check_engines(self) -> int:
        return 1

    def num_engines_alive(self) -> int:
        return 1

    def shutdown(self) -> None:
        self.running = {}

    def _group(self, request: _Running) -> RolloutGroup:
        samples = []
        for seed in request.params.sample_seeds():
            rng = random.Random(hash((tuple(request.prompt), seed)))
            tokens = [rng.randint(3, 60) for _ in range(rng.randint(1, 8))]
            times = [request.start + (i + 1) / len(tokens) * (request.end - request.start) for i in range(len(tokens))]
            versions = [max(v for t, v in self.pushes if t < when) for when in times]
            samples.append(RolloutSample(tokens, [-0.5] * len(tokens), "stop", False, policy_versions=versions))
        return RolloutGroup(request.request_id, request.prompt, samples)


def records(count: int) -> list:
    return [SimpleNamespace(prompt_ids=[index + 1, 2, 3], index=index, messages=[{"content": str(index)}])
            for index in range(count)]


def score(items):
    """Responses are right when their first token is even, except those of every third prompt, which are all right
    (their groups never vary: filter-groups drops them)."""
    scored = []
    for record, responses in items:
        acc = torch.tensor([1.0 if record.index % 3 == 0 else float(r.token_ids[0] % 2 == 0) for r in responses])
        scored.append((acc.clone(), acc, ["" for _ in responses]))
    return scored


def controller_for(engines, max_staleness=None, config_staleness=0, filtering=False, prompts=400, scorer=score):
    config = build_config({}, [f"data.train_batch_size={BATCH}", "actor_rollout_ref.rollout.n=2",
                               "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                               f"algorithm.filter_groups.enable={str(filtering).lower()}",
                               f"async_training.max_staleness={config_staleness}"])
    stream = PromptStream(records(prompts), total_epochs=1, seed=3)
    admission = admission_for(config.async_training, BATCH)
    if max_staleness is not None:  # the staleness rule at this bound, whatever the config says
        admission = StalenessAdmission(max_staleness, BATCH, admission.inflight_cap)
    return RolloutController(SingleTurnGenerator(engines), stream, scorer, admission,
                             keep_varied_groups if filtering else None,
                             lambda seed: SamplingParams(n=2, seed=seed, max_tokens=8), config.data,
                             config.algorithm.filter_groups)


def train(controller, engines, steps, in_flight, update_s=1.5):
    """The trainer's loop without the model: collect, update for `update_s` (the engines generate), push."""
    batches = []
    for step in range(1, steps + 1):
        collected = controller.collect(step, engines.weight_version)
        batches.append(collected)
        engines.advance(update_s)
        engines.begin_weight_sync(in_flight)
        engines.finish_weight_sync()
    return batches


def staleness(batch) -> list[int]:
    return [batch.policy_version - min(row) for g in batch.groups for row in g.policy_versions.tolist()]


def content(batches) -> list:
    return [[(g.seq, g.prompt_token_ids, g.response_token_ids) for g in batch.groups] for batch in batches]


@pytest.mark.parametrize("k, in_flight, filtering", [(1, "partial", False), (2, "keep", True), (3, "partial", True),
                                                   (1, "finish", True)])
def test_no_trained_sample_is_more_than_k_versions_old_under_random_finish_times(k, in_flight, filtering):
    worst, spanning = 0, 0
    for seed in range(5):
        engines = ScriptedEngines(seed)
        controller = controller_for(engines, config_staleness=k, filtering=filtering)
        for batch in train(controller, engines, steps=10, in_flight=in_flight,
                           update_s=random.Random(seed).uniform(0.2, 4.0)):
            assert batch.full and len(batch.groups) == BATCH
            worst = max(worst, *staleness(batch))
            spanning += batch.metrics["async/partial_rollout_frac"] > 0
            assert batch.metrics["async/staleness_max"] == max(staleness(batch)) <= k
        assert engines.most_running <= (k + 1) * BATCH
    assert worst >= 1  # stale samples were trained: the bound was tested
    assert (spanning > 0) == (in_flight != "finish")


@pytest.mark.parametrize("k", [1, 2])
def test_batches_do_not_depend_on_which_request_finished_first(k):
    runs = []
    for seed in (11, 12, 13):
        engines = ScriptedEngines(seed)
        runs.append(content(train(controller_for(engines, config_staleness=k, filtering=True), engines, steps=10,
                                  in_flight="partial", update_s=0.3 * seed - 2.5)))
    assert runs[0] == runs[1] == runs[2]
    seqs = [g[0] for batch in runs[0] for g in batch]
    assert seqs == sorted(seqs)  # committed in request order, across steps


def test_groups_the_filters_drop_free_their_slots():
    """Only every fourth prompt varies (is kept): a batch of 4 needs 13 prompts, more than the (k + 1) * B = 8 the
    bound holds at once; it fills only because dropped groups leave the count."""
    def one_in_four(items):
        scored = []
        for record, responses in items:
            acc = torch.tensor([float(r.token_ids[0] % 2 == 0) if record.index % 4 == 0 else 1.0 for r in responses])
            scored.append((acc.clone(), acc, ["" for _ in responses]))
        return scored

    engines = ScriptedEngines(5)
    controller = controller_for(engines, config_staleness=1, filtering=True, scorer=one_in_four)
    batches = train(controller, engines, steps=4, in_flight="partial")
    assert all(b.full for b in batches)
    assert engines.most_running <= 2 * BATCH
    assert batches[-1].metrics["filter/committed_prompts"] >= 13
    kept = [g.record.index for b in batches for g in b.groups]
    assert all(index % 4 == 0 for index in kept)


def test_k_zero_admission_forms_exactly_the_synchronous_batches():
    """The asynchronous admission at k = 0 against the synchronous loop (look-ahead, then cancel): the same
    batches, token for token, the same data position after every step, and nothing ever in flight at a push."""
    runs, positions = [], []
    for asynchronous in (False, True):
        engines = ScriptedEngines(7)
        controller = controller_for(engines, max_staleness=0 if asynchronous else None, filtering=True)
        assert isinstance(controller.admission, StalenessAdmission) == asynchronous
        batches, stream_positions = [], []
        for step in range(1, 9):
            batches.append(controller.collect(step, engines.weight_version))
            stream_positions.append(controller.state_dict())
            engines.advance(1.0)
            engines.sync_weights([], in_flight="none")  # asserts that nothing is in flight
        runs.append([[(g.record.index, g.response_token_ids, g.policy_versions.tolist()) for g in b.groups]
                     for b in batches])  # seq counts per step in the synchronous loop, per run in the other
        positions.append(stream_positions)
    assert runs[0] == runs[1]
    assert positions[0] == positions[1]


# What main's synchronous controller formed (commit 3deb490, before asynchronous training was merged) on
# `ScriptedEngines(7)` with the settings of `test_k_zero_forms_the_batches_of_the_synchronous_controller_before_it`:
# each batch's prompt indices and the data position after 8 steps, and a digest of everything (responses included).
BEFORE_ASYNC = {
    False: ([[203, 138, 218, 282], [250, 150, 48, 43], [249, 127, 209, 269], [44, 82, 210, 379],
             [139, 256, 224, 183], [278, 200, 69, 112], [170, 135, 365, 382], [147, 196, 301, 264]], 32),
    True: ([[203, 250, 43, 209], [269, 256, 112, 170], [365, 196, 301, 122], [145, 286, 221, 257],
            [374, 307, 317, 335], [19, 253, 343, 83], [2, 158, 119, 188], [35, 380, 271, 80]], 92),
}
BEFORE_ASYNC_SHA256 = "2cdedb83e0963f26c74146414b7896be995fc6d072e7abad865c5168baae8f02"


def test_k_zero_forms_the_batches_of_the_synchronous_controller_before_it():
    """`async_training.max_staleness=0` (the default) trains exactly the batches today's synchronous loop trained
    before asynchronous training existed: same prompts, same responses (so the same sampling seeds), same order, same
    data position, with and without filter-groups."""
    recorded = {}
    for filtering in (False, True):
        engines = ScriptedEngines(7)
        config = build_config({}, [f"data.train_batch_size={BATCH}", "actor_rollout_ref.rollout.n=2",
                                   "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.seed=5",
                                   f"algorithm.filter_groups.enable={str(filtering).lower()}",
                                   "async_training.max_staleness=0"])
        controller = RolloutController(SingleTurnGenerator(engines), PromptStream(records(400), 1, seed=3), score,
                                       admission_for(config.async_training, BATCH),
                                       keep_varied_groups if filtering else None,
                                       lambda seed: SamplingParams(n=2, seed=seed, max_tokens=8), config.data,
                                       config.algorithm.filter_groups)
        batches = []
        for step in range(1, 9):
            batches.append([[g.record.index, g.response_token_ids] for g in controller.collect(step).groups])
            engines.advance(1.0)
        position = controller.state_dict()
        assert ([[index for index, _ in batch] for batch in batches], position["offset"]) == BEFORE_ASYNC[filtering]
        recorded[str(filtering)] = {"batches": batches, "position": position}
    digest = hashlib.sha256(json.dumps(recorded, sort_keys=True).encode()).hexdigest()
    assert digest == BEFORE_ASYNC_SHA256


def varied_unless_third(items):
    """Every third prompt's group is uniform (dropped by filter-groups), every other one varies (kept)."""
    return [(acc.clone(), acc, ["", ""]) for acc in
            (torch.tensor([1.0, 1.0 if record.index % 3 == 0 else 0.0]) for record, _ in items)]


def test_resume_position_is_the_first_prompt_not_yet_trained():
    """What a checkpoint saves mid-run: every prompt before it was trained, every prompt from it on was not (it is in
    flight, finished and waiting, or not yet requested); a controller resumed there trains the rest exactly once."""
    engines = ScriptedEngines(9)
    controller = controller_for(engines, config_staleness=2, filtering=True, prompts=60, scorer=varied_unless_third)
    first = train(controller, engines, steps=3, in_flight="partial")
    saved = controller.state_dict()
    assert controller.open.running or controller.open.finished  # prompts were in flight at the checkpoint
    trained = [g.record.index for b in first for g in b.groups]
    committed = sum(b.metrics["filter/committed_prompts"] for b in first)
    assert saved["offset"] == committed
    resumed_engines = ScriptedEngines(10)
    resumed = controller_for(resumed_engines, config_staleness=2, filtering=True, prompts=60,
                             scorer=varied_unless_third)
    resumed.load_state_dict(saved)
    rest = train(resumed, resumed_engines, steps=30, in_flight="partial")
    trained += [g.record.index for b in rest if b.trainable for g in b.groups]
    assert len(trained) == len(set(trained))  # none twice
    order = [records(60)[i].index for i in PromptStream(records(60), 1, 3)._epoch_order(0)]
    varied = [index for index in order if index % 3 != 0]  # what filter-groups keeps
    assert trained == varied[: len(trained)] and len(trained) >= len(varied) - BATCH  # none lost


@pytest.mark.parametrize("overrides, message", [
    (["async_training.max_staleness=1", "actor_rollout_ref.rollout.mode=colocate"], "colocated engines share"),
    (["async_training.partial_rollout=false", "async_training.in_flight_weight_updates=true"],
     "in_flight_weight_updates=true continues requests"),
    (["async_training.max_staleness=-1"], "max_staleness=-1 must be >= 0"),
    (["algorithm.rollout_correction.rollout_is=token", "actor_rollout_ref.actor.tis_imp_ratio_cap=2.0"],
     "both weight the loss"),
])
def test_settings_that_cannot_work_are_refused_in_one_line(overrides, message):
    from megatron_cpo.config import ConfigError

    with pytest.raises(ConfigError, match=message) as error:
        build_config({}, overrides)
    assert "\n" not in str(error.value)


def test_in_flight_policy_follows_the_settings():
    policies = {}
    for overrides in ([], ["async_training.max_staleness=1"], ["async_training.max_staleness=1",
                                                                "async_training.partial_rollout=false"],
                      ["async_training.max_staleness=2", "async_training.in_flight_weight_updates=true"]):
        policies[" ".join(overrides)] = build_config({}, overrides).async_training.in_flight
    assert list(policies.values()) == ["none", "partial", "finish", "keep"]
