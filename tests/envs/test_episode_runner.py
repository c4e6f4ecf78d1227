"""The episode runner with scripted token ids (tests/envs/scripted.py; no engine): mask and log-prob alignment across
turns, the prefix property, limits and budget truncation, environment errors and timeouts, independent episodes,
cancellation and the template check. The chat template is the tiny model's (Qwen-style "<|im_end|>\\n")."""
import threading
import time

import pytest
import torch

from megatron_cpo.data.dataset import PromptRecord
from megatron_cpo.envs import EnvironmentRegistry, EpisodeRunner, MultiTurnConfig
from megatron_cpo.envs.base import user
from megatron_cpo.envs.metrics import episode_metrics
from megatron_cpo.envs.templates import ChatTemplate
from megatron_cpo.models.tiny import build_char_tokenizer
from megatron_cpo.rollout.types import SamplingParams
from tests.conditions import wait_until
from tests.envs.scripted import Counted, HeldUntilReleased, HoldsFirstStep, ScriptedEngines, SlowFirst, SlowScore

TOKENIZER = build_char_tokenizer()
EOS = TOKENIZER.eos_token_id
COUNTDOWN = "tests.envs.scripted:CountdownEnvironment"


def ids(text: str) -> list[int]:
    return TOKENIZER(text, add_special_tokens=False)["input_ids"]


def record(text: str = "go", agent: str = "", ground_truth: str = "5") -> PromptRecord:
    messages = [{"role": "user", "content": text}]
    return PromptRecord(uid="", index=0, messages=messages,
                        prompt_ids=ChatTemplate(TOKENIZER).prompt_ids(messages, None),
                        data_source="megatron_cpo/arith", ground_truth=ground_truth, agent_name=agent)


def make_runner(script, budget: int = 96, **settings):
    settings.setdefault("default_agent", COUNTDOWN)
    config = MultiTurnConfig(enable=True, **settings)
    engines = ScriptedEngines(script)
    return EpisodeRunner(engines, TOKENIZER, EnvironmentRegistry(config), budget, 256, poll_s=0.005), engines


def answer(text: str):
    """A script answering every turn with `text` and the end-of-turn token."""
    return lambda request, turn: (ids(text) + [EOS], "stop")


def run_group(runner, n: int = 1, seed: int | None = 7, row=None):
    runner.submit("g0", row or record(), SamplingParams(n=n, max_tokens=999, stop_token_ids=(EOS,), seed=seed))
    [group] = runner.finished(timeout=30)
    runner.close()
    return group


def test_three_turns_align_mask_and_log_probs_and_each_turn_extends_the_last():
    runner, engines = make_runner(lambda request, turn: (ids(f"a{turn}") + [EOS], "stop"),
                                  agent_kwargs={COUNTDOWN: {"turns": 3}})
    group = run_group(runner)
    [sample] = group.samples
    turn_ids = [ids(f"a{turn}") + [EOS] for turn in range(3)]
    observations = [f"\n<|im_start|>user\nleft {k}<|im_end|>\n<|im_start|>assistant\n" for k in (2, 1)]
    expected = turn_ids[0] + ids(observations[0]) + turn_ids[1] + ids(observations[1]) + turn_ids[2]
    assert sample.token_ids == expected
    assert sample.loss_mask == [1] * 3 + [0] * len(ids(observations[0])) + [1] * 3 + \
           [0] * len(ids(observations[1])) + [1] * 3
    engine_log_probs = [[-(turn + 1) - k / 100 for k in range(3)] for turn in range(3)]
    zeros = [[0.0] * len(ids(text)) for text in observations]
    assert sample.logprobs == pytest.approx(engine_log_probs[0] + zeros[0] + engine_log_probs[1] + zeros[1] +
                                            engine_log_probs[2])
    # the prefix property: every turn's prompt is the previous prompt + what was sampled + the observation
    prompts = [request.prompt_ids for request in engines.requests]
    assert prompts[0] == group.prompt_token_ids
    for previous, current, turn in zip(prompts, prompts[1:], turn_ids):
        assert current[:len(previous) + len(turn)] == previous + turn
    assert group.prompt_token_ids + sample.token_ids == ChatTemplate(TOKENIZER).encode(ChatTemplate(TOKENIZER).render(
        [*record().messages, {"role": "assistant", "content": "a0"}, user("left 2"),
         {"role": "assistant", "content": "a1"}, user("left 1"), {"role": "assistant", "content": "a2"}],
        None, False))[:-1]  # all but the template's final "\n"
    episode = sample.episode
    assert (episode.turns, episode.observations, episode.stop_reason, episode.template_check) == (3, 2, "done", "same")
    assert episode.turn_rewards == [0.1, 0.1, 1.0] and episode.final_score == 0.0 and not sample.truncated
    assert episode.observation_tokens == sample.loss_mask.count(0) and episode.final_answer == "a2"


def test_seeds_differ_per_episode_and_turn_and_the_group_starts_from_one_state():
    runner, engines = make_runner(answer("x"), agent_kwargs={COUNTDOWN: {"turns": 2}})
    group = run_group(runner, n=3, seed=11)
    seeds = [request.params.seed for request in engines.requests]
    assert len(seeds) == 6 and len(set(seeds)) == 6 and all(r.params.n == 1 for r in engines.requests)
    again, engines_again = make_runner(answer("x"), agent_kwargs={COUNTDOWN: {"turns": 2}})
    run_group(again, n=3, seed=11)
    assert sorted(seeds) == sorted(r.params.seed for r in engines_again.requests)
    assert len(group.samples) == 3 and len({tuple(r.prompt_ids) for r in engines.requests
                                            if r.request_id.endswith("|t0")}) == 1


def test_turn_limits_end_the_episode_after_the_last_allowed_turn_is_stepped():
    runner, _ = make_runner(answer("x"), max_assistant_turns=2, agent_kwargs={COUNTDOWN: {"turns": 9}})
    episode = run_group(runner).samples[0].episode
    assert (episode.turns, episode.stop_reason, episode.turn_rewards) == (2, "max_assistant_turns", [0.1, 0.1])
    runner, _ = make_runner(answer("x"), max_user_turns=1, agent_kwargs={COUNTDOWN: {"turns": 9}})
    episode = run_group(runner).samples[0].episode
    assert (episode.turns, episode.observations, episode.stop_reason) == (2, 1, "max_user_turns")


def test_a_turn_cut_by_the_per_turn_cap_or_the_budget_ends_the_episode_truncated():
    long_answer = lambda request, turn: (ids("y" * 30) + [EOS], "stop")  # noqa: E731
    runner, engines = make_runner(long_answer, max_tokens_per_turn=8, agent_kwargs={COUNTDOWN: {"turns": 9}})
    sample = run_group(runner).samples[0]
    assert sample.episode.stop_reason == "turn_length" and sample.truncated and sample.episode.turns == 1
    assert len(sample.token_ids) == 8 and engines.requests[0].params.max_tokens == 8
    # one response budget over model and observation tokens: the second turn gets what the first and the observation
    # left, is cut there, and no third turn follows
    runner, engines = make_runner(lambda request, turn: (ids("z" * 30) + [EOS], "stop"), budget=70,
                                  agent_kwargs={COUNTDOWN: {"turns": 9}})
    sample = run_group(runner).samples[0]
    observation = len(ids("\n<|im_start|>user\nleft 8<|im_end|>\n<|im_start|>assistant\n"))
    assert engines.requests[1].params.max_tokens == 70 - 31 - observation
    assert len(sample.token_ids) == 70 and sample.episode.stop_reason == "response_length" and sample.truncated
    assert len(engines.requests) == 2


def test_an_observation_that_does_not_fit_ends_the_episode_before_it_is_added():
    runner, _ = make_runner(answer("z" * 20), budget=40, agent_kwargs={COUNTDOWN: {"turns": 9}})
    sample = run_group(runner).samples[0]
    assert sample.episode.stop_reason == "observation_length" and sample.truncated
    assert sample.token_ids == ids("z" * 20) + [EOS] and sample.loss_mask == [1] * 21


def test_a_raising_step_is_an_error_observation_and_a_hanging_one_ends_its_episode():
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:Flaky")
    sample = run_group(runner).samples[0]
    text = TOKENIZER.decode(sample.token_ids, skip_special_tokens=False)
    assert "<|im_start|>user\nError: RuntimeError: the game server is down<|im_end|>" in text
    assert (sample.episode.env_errors, sample.episode.turns, sample.episode.stop_reason) == (1, 3, "done")
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:Flaky",
                            agent_kwargs={"tests.envs.scripted:Flaky": {"hang": True}}, call_timeout_s=0.3)
    started = time.monotonic()
    sample = run_group(runner).samples[0]
    assert time.monotonic() - started < 4, "the runner waited for the hanging step"
    assert (sample.episode.env_timeouts, sample.episode.stop_reason, sample.episode.turns) == (1, "env_timeout", 2)
    hung = [t for t in threading.enumerate() if t.name.startswith("megatron-cpo-env") and t.is_alive()]
    assert hung and all(t.daemon for t in hung)  # the hung step keeps a thread, never the process from exiting


def test_non_finite_step_rewards_and_final_scores_are_refused_where_they_arrive():
    """NaN and infinite rewards become 0 in the episode, each described (environment, call, turn, row) for
    `reward.non_finite` to decide (the trainer's scorer); the error handling above is unchanged."""
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:NonFiniteRewards")
    [sample] = run_group(runner, row=record(agent="")).samples
    info = sample.episode
    assert info.turn_rewards == [0.0, 0.0] and info.final_score == 0.0 and info.stop_reason == "done"
    where = "of episode 0 of row 0 (data_source 'megatron_cpo/arith')"
    assert info.non_finite_rewards == [
        f"environment 'tests.envs.scripted:NonFiniteRewards' (NonFiniteRewards.step) gave nan as the reward of turn 1 "
        f"{where}",
        f"environment 'tests.envs.scripted:NonFiniteRewards' (NonFiniteRewards.step) gave inf as the reward of turn 2 "
        f"{where}",
        f"environment 'tests.envs.scripted:NonFiniteRewards' (NonFiniteRewards.score) gave -inf as the final score "
        f"{where}"]
    assert episode_metrics([info])["multi_turn/non_finite_rewards"] == 3


def test_episodes_advance_independently():
    SlowFirst.others_done, SlowFirst.blocking = threading.Event(), threading.Lock()

    def script(request, turn):
        if turn == 2:
            SlowFirst.others_done.set()
        return ids("m") + [EOS], "stop"

    runner, engines = make_runner(script, default_agent="tests.envs.scripted:SlowFirst", call_timeout_s=20)
    group = run_group(runner, n=2)
    order = [request.request_id.split("|", 1)[1] for request in engines.requests]
    slow = max((0, 1), key=lambda e: order.index(f"e{e}|t1"))
    assert order.index(f"e{1 - slow}|t2") < order.index(f"e{slow}|t1"), order
    assert [s.episode.turns for s in group.samples] == [3, 3] and all(s.episode.env_errors == 0 for s in group.samples)


def test_cancel_all_drops_episodes_in_flight_and_a_resubmitted_group_starts_over():
    """Two episodes are mid-way (their first step held); cancel_all drops them, closes each environment once (the
    held ones once their step returns), and the same group submitted again runs whole from turn 0."""
    HeldUntilReleased.release = threading.Event()
    Counted.reset_counts()
    runner, engines = make_runner(answer("x"), default_agent="tests.envs.scripted:CountedHeld")
    params = SamplingParams(n=2, max_tokens=99, stop_token_ids=(EOS,), seed=3)
    held_row = record()
    held_row.extra_info = {"held": True}
    runner.submit("g0", held_row, params)
    wait_until(lambda: len(runner.calls.out) == 2 and all(f.started for f in runner.calls.out), 10,
               "both episodes inside their first step")
    assert runner.cancel_all() == 1 and runner.finished(timeout=1) == []
    first = len(engines.requests)
    assert sorted(r.request_id.split("|", 1)[1] for r in engines.requests) == ["e0|t0", "e1|t0"]
    HeldUntilReleased.release.set()
    wait_until(lambda: Counted.closed_once(2), 10, "the held environments closed once their step returned")
    runner.submit("g0", record(), params)
    [group] = runner.finished(timeout=30)
    fresh = [r.request_id.split("|", 1)[1] for r in engines.requests[first:]]
    assert sorted(fresh) == sorted(f"e{e}|t{t}" for e in range(2) for t in range(2))  # from turn 0, whole
    assert all(s.episode.turns == 2 for s in group.samples)
    runner.close()
    wait_until(lambda: Counted.closed_once(4), 10, "every environment closed once")


def test_every_sampled_token_keeps_its_weight_version_across_a_push_and_observations_carry_the_previous():
    """Turn 0 sampled by version 3, then a push (the scripted engines now serve version 4) before turns 1 and 2: the
    episode's versions follow its tokens, and each observation id carries the version of the sampled id before it."""
    cell = {}

    def script(request, turn):
        cell["engines"].version = 3 if turn == 0 else 4
        return ids(f"a{turn}") + [EOS], "stop"

    runner, engines = make_runner(script, agent_kwargs={COUNTDOWN: {"turns": 3}})
    cell["engines"] = engines
    [sample] = run_group(runner).samples
    mask = sample.loss_mask
    first_observation = mask.index(0)
    expected, last = [], None
    for position, sampled in enumerate(mask):
        if sampled:
            last = 3 if position < first_observation else 4
        expected.append(last)
    assert sample.policy_versions == expected
    assert sample.policy_versions[:first_observation + 1] == [3] * (first_observation + 1)  # obs after turn 0: 3
    assert set(sample.policy_versions) == {3, 4} and len(sample.policy_versions) == len(sample.token_ids)


def test_no_turn_is_submitted_while_the_runner_is_held():
    """Weights are pushed with the runner held: the episodes' resets return meanwhile, but their first turns reach
    the engines only after the hold."""
    runner, engines = make_runner(answer("x"), agent_kwargs={COUNTDOWN: {"turns": 2}})
    with runner.held():
        runner.submit("g0", record(), SamplingParams(n=2, max_tokens=99, stop_token_ids=(EOS,), seed=1))
        wait_until(lambda: all(f.done() for f in runner.calls.out), 10, "both resets returned")
        with pytest.raises(TimeoutError):
            runner.finished(timeout=0)
        assert engines.requests == []
    [group] = runner.finished(timeout=30)
    assert [s.episode.turns for s in group.samples] == [2, 2]
    runner.close()


def test_each_environment_is_closed_once_whatever_ends_its_episode():
    """A score that outlasts the call timeout closes its environment when it returns (once, not again by the
    runner); cancelling a group whose one episode finished (closed by its score call) and whose other is mid-step
    closes each once."""
    Counted.reset_counts()
    SlowScore.release = threading.Event()
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:SlowScore", call_timeout_s=0.3,
                            env_workers=1)
    runner.submit("g0", record(), SamplingParams(n=1, max_tokens=99, stop_token_ids=(EOS,), seed=1))
    [sample] = runner.finished(timeout=30)[0].samples
    assert (sample.episode.env_timeouts, sample.episode.stop_reason) == (1, "done")
    SlowScore.release.set()
    runner.calls.pool.submit(lambda: None).result(timeout=10)  # one thread: whatever the score queued has run
    assert Counted.closed_once(1) and sum(Counted.closes.values()) == 1
    runner.close()

    Counted.reset_counts()
    HoldsFirstStep.release, HoldsFirstStep.taken = threading.Event(), threading.Lock()
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:HoldsFirstStep")
    runner.submit("g0", record(), SamplingParams(n=2, max_tokens=99, stop_token_ids=(EOS,), seed=1))
    wait_until(lambda: sum(Counted.closes.values()) == 1, 10, "the episode that was not held finished and closed")
    assert runner.cancel_all() == 1
    HoldsFirstStep.release.set()
    runner.close()
    wait_until(lambda: sum(Counted.closes.values()) == 2, 10, "the held environment closed after its step")
    assert Counted.closed_once(2)


def test_a_failure_of_the_driver_reaches_the_caller_of_finished_and_cancel_all_starts_it_again():
    """An environment whose episodes start from different conversations is a programming error: the driver thread
    stops and `finished` raises it, naming the rule. `cancel_all` (what the trainer does when every engine was lost,
    before it collects the step again) drops what was in flight and starts a new driver: the next group runs."""
    runner, _ = make_runner(answer("x"), default_agent="tests.envs.scripted:Diverging")
    runner.submit("g0", record(), SamplingParams(n=2, max_tokens=99, stop_token_ids=(EOS,), seed=1))
    with pytest.raises(ValueError, match="must depend on the record and the seed only"):
        runner.finished(timeout=30)
    runner.cancel_all()
    runner.submit("g1", record(agent=COUNTDOWN), SamplingParams(n=2, max_tokens=99, stop_token_ids=(EOS,), seed=1))
    [group] = runner.finished(timeout=30)
    assert group.request_id == "g1" and all(sample.episode.turns >= 1 for sample in group.samples)
    runner.close()


@pytest.mark.parametrize("mode, excluded", [("strict", True), ("warn", False), ("off", False)])
def test_the_sanity_check_excludes_a_differing_episode_only_in_strict_mode(mode, excluded):
    # the model writes a special token inside its answer: the conversation's text cannot reproduce its ids
    runner, _ = make_runner(lambda request, turn: ([ids("a")[0], TOKENIZER.convert_tokens_to_ids("<|im_start|>"), EOS],
                                                   "stop"),
                            default_agent="tests.envs.scripted:SpellsEndOfTurn",
                            tokenization_sanity_check_mode=mode)
    sample = run_group(runner).samples[0]
    assert sample.episode.template_check == ("off" if mode == "off" else "differs")
    assert sample.loss_mask == ([0, 0, 0] if excluded else [1, 1, 1])


def test_the_controller_cancels_episodes_in_flight_and_the_next_step_regenerates_them_whole():
    """The batch fills while prompt 3's episodes are mid-way (their first step is held): they are cancelled, the data
    stream goes back to prompt 3, and the next step runs its episodes from turn 0; no part of them was trained."""
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.driver.accumulator import keep_varied_groups
    from megatron_cpo.trainer.driver.admission import admission_for
    from megatron_cpo.trainer.driver.controller import RolloutController
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream
    from tests.envs.scripted import HeldUntilReleased

    HeldUntilReleased.release = threading.Event()
    rows = [record(f"q{i}") for i in range(6)]
    for index, row in enumerate(rows):
        row.index, row.extra_info = index, {"held": index == 3}
    runner, engines = make_runner(answer("x"), default_agent="tests.envs.scripted:HeldUntilReleased")
    config = build_config({}, ["data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                               "actor_rollout_ref.rollout.n=2", "algorithm.filter_groups.enable=true"])

    def scorer(items):  # prompt 1's group is uniform (filtered), the others mixed
        return [(torch.tensor([1.0 if row.index != 1 else 0.0, 0.0]),) * 2 + (["", ""],) for row, _ in items]

    stream = PromptStream(rows, total_epochs=1, seed=0, shuffle=False)
    controller = RolloutController(runner, stream, scorer, admission_for(config.async_training, 2), keep_varied_groups,
                                   lambda seed: SamplingParams(n=2, max_tokens=32, stop_token_ids=(EOS,), seed=seed),
                                   config.data, config.algorithm.filter_groups)
    history = controller.admission.keep_history
    history.kept, history.committed = 1.0, 4.0  # a low keep rate: look ahead
    first = controller.collect(step=1)
    assert [g.record.index for g in first.groups] == [0, 2] and all(
        e.turns == 2 for g in first.groups for e in g.episodes)
    assert stream.position.offset == 3, "the stream goes back to prompt 3, whose episodes were in flight"
    held = [r.request_id for r in engines.requests if r.request_id.startswith("step1-e0-o3|")]
    assert held and all(r.endswith("|t0") for r in held), "prompt 3 was cut after its first turn"
    assert runner.outstanding == 0
    HeldUntilReleased.release.set()
    second = controller.collect(step=2)
    assert [g.record.index for g in second.groups][:1] == [3]
    regenerated = [r.request_id.split("|", 1)[1] for r in engines.requests if r.request_id.startswith("step2-e0-o3|")]
    assert sorted(regenerated) == ["e0|t0", "e0|t1", "e1|t0", "e1|t1"]
    assert all(e.turns == 2 and e.stop_reason == "done" for e in second.groups[0].episodes)
    runner.close()
