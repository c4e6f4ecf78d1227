"""The streaming controller against a real vLLM engine and the real grading pool: filter-groups drops groups,
batches are exact, unused prompts go back to the data stream, both `on_limit` behaviours, and RAGEN's windows."""
import pytest
import torch
from transformers import AutoTokenizer

from megatron_cpo.trainer.controller import GenerationLimitError
from megatron_cpo.trainer.rollout_side import RolloutSide


@pytest.fixture
def side_for(rollout_manager, tiny_model):
    sides = []
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def make(config):
        sides.append(RolloutSide(config, tokenizer, rollout_manager))
        return sides[-1]
    yield make
    for side in sides:
        side.close()


def test_filter_groups_drops_uniform_groups_and_fills_an_exact_batch(make_config, side_for):
    side = side_for(make_config("algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=8"))
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
                                "algorithm.filter_groups.on_limit=use_partial"))
    collected = side.controller.collect(step=1)
    assert not collected.full and not collected.data_exhausted
    assert 0 < len(collected.groups) < 4
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
