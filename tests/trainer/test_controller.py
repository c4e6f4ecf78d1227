"""The streaming controller against a real vLLM engine and the real grading pool: filter-groups drops groups,
batches are exact, unused prompts go back to the data stream, both `on_limit` behaviours, RAGEN's windows,
and the look-ahead (how many prompts are requested) changes only speed, never which groups form the batch."""
import pytest
import torch
from transformers import AutoTokenizer

from megatron_cpo.trainer.driver.accumulator import GroupAccumulator, keep_varied_groups
from megatron_cpo.trainer.driver.admission import KeepRateHistory, prompts_to_request
from megatron_cpo.trainer.driver.controller import GenerationLimitError
from megatron_cpo.trainer.driver.lead import LeadDriver


@pytest.fixture
def side_for(rollout_manager, tiny_model):
    sides = []
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def make(config):
        sides.append(LeadDriver(config, tokenizer, rollout_manager))
        return sides[-1]
    yield make
    for side in sides:
        side.close()


MIXED_ON_EVEN_ROWS = "reward.custom_reward_function=tests.trainer.graders:mixed_on_even_rows"


def test_filter_groups_drops_uniform_groups_and_fills_an_exact_batch(make_config, side_for):
    side = side_for(make_config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=8",
                                MIXED_ON_EVEN_ROWS))
    collected = side.controller.collect(step=1)
    metrics = collected.metrics
    assert collected.full and len(collected.groups) == 4
    assert all(g.n == 2 and torch.std(g.acc) > 0 for g in collected.groups)
    assert metrics["filter/filtered_prompts"] > 0
    assert metrics["filter/committed_prompts"] == metrics["filter/kept_prompts"] + metrics["filter/filtered_prompts"]
    assert side.stream.position.offset == metrics["filter/committed_prompts"]  # unused prompts went back
    assert [g.seq for g in collected.groups] == sorted(g.seq for g in collected.groups)


def test_limit_reached_raises_with_the_fix(make_config, side_for):
    side = side_for(make_config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=2",
                                "reward.custom_reward_function=tests.trainer.graders:never_correct"))
    with pytest.raises(GenerationLimitError, match="max_num_gen_batches=2.*on_limit=use_partial"):
        side.controller.collect(step=1)
    assert side.stream.position.offset == 8  # exactly max_num_gen_batches * train_batch_size prompts were used


def test_limit_reached_trains_on_the_partial_batch(make_config, side_for):
    side = side_for(make_config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=1",
                                "algorithm.filter_groups.on_limit=use_partial", MIXED_ON_EVEN_ROWS))
    collected = side.controller.collect(step=1)
    assert not collected.full and not collected.data_exhausted
    assert len(collected.groups) == 2  # the stream's first four rows are 34, 28, 23 and 1 (seed 1)
    assert collected.metrics["filter/num_gen_batches"] == 1
    assert collected.metrics["timing/requested_prompts"] == 4


def test_validation_reports_held_out_accuracy(make_config, side_for):
    metrics = side_for(make_config()).validate()
    assert metrics["val/count"] == 8 and 0.0 <= metrics["val/acc"] <= 1.0


def test_ragen_top_k_keeps_the_best_groups_of_each_generation_batch(make_config, side_for):
    side = side_for(make_config("actor_rollout_ref.rollout.rollout_filter_strategy=top_k",
                                "actor_rollout_ref.rollout.rollout_filter_value=2",
                                "algorithm.filter_groups.max_num_gen_batches=4"))
    collected = side.controller.collect(step=1)
    metrics = collected.metrics
    assert collected.full and len(collected.groups) == 4
    assert metrics["filter/kept_ratio"] == 0.5  # 2 of each generation batch of 4, two batches judged whole
    assert metrics["filter/num_gen_batches"] == 2 and 6 <= metrics["filter/committed_prompts"] <= 8
    assert side.stream.position.offset == metrics["filter/committed_prompts"]  # the rest went back to the stream
    assert [g.seq for g in collected.groups] == sorted(g.seq for g in collected.groups)


def _fill_probability(prompts: int, keep_rate: float, needed: int) -> float:
    """P(Binomial(prompts, keep_rate) >= needed), exactly."""
    if keep_rate >= 1.0:
        return float(prompts >= needed)
    below = torch.distributions.Binomial(prompts, torch.tensor(keep_rate, dtype=torch.float64)).log_prob(
        torch.arange(needed, dtype=torch.float64)).exp().sum()
    return float(1.0 - below)


@pytest.mark.parametrize("keep_rate", [0.05, 0.3, 0.7, 0.95, 1.0])
def test_look_ahead_fills_the_batch_with_about_90_percent_probability(keep_rate):
    for needed in (1, 4, 8, 64):
        prompts = prompts_to_request(needed, keep_rate)
        smallest = needed  # the fewest prompts that fill with probability >= 0.9
        while _fill_probability(smallest, keep_rate, needed) < 0.9:
            smallest += 1
        assert smallest <= prompts <= 1.5 * smallest + 1, (needed, prompts, smallest)
    assert prompts_to_request(8, 1.0) == 8 and prompts_to_request(0, 0.3) == 0


def test_keep_rate_history_starts_at_one_and_halves_each_step():
    history = KeepRateHistory()
    assert history.rate(0, 0) == 1.0
    history.update(kept=2, committed=10)
    history.update(kept=2, committed=10)
    assert (history.kept, history.committed) == (3.0, 15.0)
    assert history.rate(1, 5) == pytest.approx(5 / 21)


def test_finished_returns_every_group_once_and_then_nothing(rollout_manager, tiny_model):
    from megatron_cpo.rollout import SamplingParams

    params = SamplingParams(n=2, max_tokens=4, seed=3)
    for index in range(3):
        rollout_manager.submit(f"finished-{index}", [5, 6, 7 + index], params)
    seen = []
    while batch := rollout_manager.finished(timeout=120):
        seen.extend(group.request_id for group in batch)
    assert sorted(seen) == [f"finished-{index}" for index in range(3)]


def test_look_ahead_changes_requests_but_never_the_batch(make_config, side_for):
    config = make_config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=8")
    exact, eager = side_for(config), side_for(config)
    # the exact side expects every group kept (requests only what it still needs), the eager side almost none kept
    # (requests up to the in-flight cap); a history that strong outweighs what one step observes, so the request
    # counts differ whatever the engine's timing
    exact.controller.admission.keep_history = KeepRateHistory(kept=1000.0, committed=1000.0)
    eager.controller.admission.keep_history = KeepRateHistory(kept=0.0, committed=100.0)
    batches = [side.controller.collect(step=1) for side in (exact, eager)]
    assert batches[1].metrics["timing/requested_prompts"] > batches[0].metrics["timing/requested_prompts"]
    assert [g.seq for g in batches[0].groups] == [g.seq for g in batches[1].groups]
    assert [g.response_token_ids for g in batches[0].groups] == [g.response_token_ids for g in batches[1].groups]
    assert exact.stream.position == eager.stream.position
    assert batches[1].metrics["timing/score_calls"] <= batches[1].metrics["filter/committed_prompts"]


def test_only_prompts_on_the_engines_count_against_the_in_flight_cap(make_config, side_for):
    """A long response at the head of the request order holds up committing (groups commit in request order), not
    generation: prompts that finished behind it no longer count against `max_inflight_prompts`, so the controller
    tops the engines up again, up to the uncommitted prompts the keep rate calls for."""
    side = side_for(make_config("algorithm.filter_groups.enable=true",
                                "actor_rollout_ref.rollout.max_inflight_prompts=4"))
    controller = side.controller
    # expects ~1% kept: wants many prompts
    controller.admission.keep_history = KeepRateHistory(kept=0.0, committed=100.0)
    accumulator = GroupAccumulator(4, keep_varied_groups)
    open_ = controller.open  # the controller's own bookkeeping: `issued` prompts, `running` on the engines
    try:
        controller._top_up(1, accumulator)
        assert open_.issued == len(open_.running) == 4
        for request_id in list(open_.running)[1:]:  # the three later prompts finished; the first still runs
            del open_.running[request_id]
        controller._top_up(1, accumulator)
        assert (open_.issued, len(open_.running), accumulator.next_seq) == (7, 4, 0)
        # expecting every group kept, 4 uncommitted prompts fill the batch; 7 are uncommitted, so none is requested
        controller.admission.keep_history = KeepRateHistory(kept=1000.0, committed=1000.0)
        for request_id in list(open_.running)[1:]:
            del open_.running[request_id]
        controller._top_up(1, accumulator)
        assert (open_.issued, len(open_.running)) == (7, 1)
    finally:
        side.engines.cancel_all()
