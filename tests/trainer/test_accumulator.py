"""Filter-and-accumulate on scored groups built from real tokenizer output: order, filtering, truncation, rewind,
RAGEN windows and the overlong penalty."""
import pytest
import torch

from megatron_cpo.algorithms.config import OverlongBufferConfig, RolloutFilterConfig
from megatron_cpo.models.tiny import build_char_tokenizer
from megatron_cpo.trainer.driver.accumulator import (
    GroupAccumulator,
    GroupSelection,
    ScoredGroup,
    keep_varied_groups,
)
from megatron_cpo.trainer.driver.prompt_stream import PromptStream


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer()


def scored_group(tokenizer, seq, answers, truth="4"):
    """A group of responses `answer is <a>`; acc is whether <a> equals the truth (exact match of the final token)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    responses = [tokenizer.encode(f"answer is {a}") for a in answers]
    acc = torch.tensor([float(tokenizer.decode(r).split()[-1] == truth) for r in responses])
    return ScoredGroup(seq=seq, record={"seq": seq}, prompt_token_ids=list(prompt), response_token_ids=responses,
                       rollout_log_probs=[[-1.0] * len(r) for r in responses],
                       truncated=torch.zeros(len(answers), dtype=torch.bool), scores=acc.clone(), acc=acc,
                       response_texts=[tokenizer.decode(r) for r in responses])


def test_filter_drops_uniform_groups_and_truncates(tokenizer):
    accumulator = GroupAccumulator(2, keep_varied_groups, "acc")
    mixed, all_right, all_wrong, mixed2, mixed3 = (["4", "5"], ["4", "4"], ["3", "5"], ["5", "4"], ["4", "1"])
    accumulator.add([scored_group(tokenizer, 1, all_right), scored_group(tokenizer, 2, all_wrong)])
    # seq 0 has not finished: nothing is committed out of order
    assert accumulator.next_seq == 0 and not accumulator.kept
    accumulator.add([scored_group(tokenizer, 0, mixed), scored_group(tokenizer, 4, mixed3)])
    assert accumulator.next_seq == 3 and len(accumulator.kept) == 1 and not accumulator.full
    accumulator.add([scored_group(tokenizer, 3, mixed2)])
    assert accumulator.full
    assert [g.seq for g in accumulator.batch()] == [0, 3]
    assert accumulator.next_seq == 4  # seq 4 finished but is not used: it goes back to the data stream
    metrics = accumulator.metrics()
    assert metrics["filter/filtered_prompts"] == 2
    assert metrics["filter/filtered_all_correct"] == 1 and metrics["filter/filtered_all_wrong"] == 1
    assert metrics["filter/filter_rate"] == pytest.approx(0.5)
    assert metrics["filter/kept_ratio"] == pytest.approx(3 / 5)  # seq 4 was judged (kept) though not used
    assert accumulator.stats.filtered_trajectories == 4


def test_without_filter_every_group_is_kept(tokenizer):
    accumulator = GroupAccumulator(3)
    accumulator.add([scored_group(tokenizer, i, ["4", "4"]) for i in range(5)])
    assert [g.seq for g in accumulator.batch()] == [0, 1, 2] and accumulator.next_seq == 3


def test_duplicate_groups_are_rejected(tokenizer):
    accumulator = GroupAccumulator(3)
    accumulator.add([scored_group(tokenizer, 0, ["4", "5"])])
    with pytest.raises(ValueError, match="already added"):
        accumulator.add([scored_group(tokenizer, 0, ["4", "5"])])


def test_prompt_stream_epochs_and_rewind():
    stream = PromptStream(list(range(5)), total_epochs=2, seed=3)
    first = [stream.next() for _ in range(7)]
    epoch0 = sorted(record for position, record in first[:5])
    assert epoch0 == list(range(5)) and first[5][0].epoch == 1
    stream.rewind(first[3][0])
    assert stream.next() == first[3]
    state = stream.state_dict()
    again = PromptStream(list(range(5)), total_epochs=2, seed=3)
    again.load_state_dict(state)
    assert [again.next() for _ in range(3)] == [stream.next() for _ in range(3)]
    rest = [stream.next() for _ in range(4)]
    assert rest[-1] is None and stream.exhausted


def scored_with(tokenizer, seq, scores, lengths=None):
    """A group whose responses have the given scores (acc = score > 0) and token lengths."""
    group = scored_group(tokenizer, seq, ["4"] * len(scores))
    if lengths is not None:
        group.response_token_ids = [[5] * length for length in lengths]
    group.scores = torch.tensor(scores, dtype=torch.float32)
    group.acc = (group.scores > 0).float()
    return group


def test_ragen_top_k_decides_whole_generation_batches(tokenizer):
    # windows of 4 groups; top_k=2 by in-group reward std keeps the two most varied groups of each window
    top_2 = RolloutFilterConfig(rollout_filter_strategy="top_k", rollout_filter_value=2)
    selection = GroupSelection(ragen=top_2, window=4)
    accumulator = GroupAccumulator(3, selection)
    scores = {0: [0.0, 1.0], 1: [0.0, 0.0], 2: [0.0, 0.5], 3: [1.0, 1.0],
              4: [0.2, 0.3], 5: [0.0, 1.0], 6: [0.0, 0.9], 7: [0.5, 0.5]}
    accumulator.add([scored_with(tokenizer, seq, scores[seq]) for seq in (0, 1, 2)])
    assert not accumulator.kept and accumulator.next_seq == 3  # the window is not complete: nothing decided yet
    accumulator.add([scored_with(tokenizer, 3, scores[3])])
    assert [g.seq for g in accumulator.kept] == [0, 2]
    accumulator.add([scored_with(tokenizer, seq, scores[seq]) for seq in (4, 5, 6, 7)])
    assert accumulator.full and [g.seq for g in accumulator.batch()] == [0, 2, 5]
    assert accumulator.next_seq == 6  # 6 and 7 were judged in the window but go back to the data stream
    metrics = accumulator.metrics()
    assert metrics["filter/kept_ratio"] == pytest.approx(4 / 8)  # the filter kept 2 of every 4 it judged
    stds = [torch.tensor(scores[s]).std().item() for s in range(8)]
    assert metrics["rollout/in_group_reward_std"] == pytest.approx(sum(stds) / 8)


def test_ragen_ranks_only_groups_that_pass_filter_groups_and_decides_a_partial_window(tokenizer):
    top_1 = RolloutFilterConfig(rollout_filter_strategy="top_k", rollout_filter_value=1)
    selection = GroupSelection(metric_filter=keep_varied_groups, ragen=top_1, window=4)
    accumulator = GroupAccumulator(2, selection)
    # group 0 has the largest std but an all-correct acc, so filter-groups drops it before RAGEN ranks
    accumulator.add([scored_with(tokenizer, 0, [0.1, 1.0]), scored_with(tokenizer, 1, [0.0, 0.4]),
             scored_with(tokenizer, 2, [0.0, 0.6])])
    assert not accumulator.kept
    # collection stopped (data ran out): the partial window is decided
    assert [g.seq for g in accumulator.batch()] == [2]
    assert accumulator.metrics()["filter/kept_ratio"] == pytest.approx(1 / 3)


def test_ragen_length_metric_and_options_from_the_config(tokenizer):
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.driver.accumulator import group_selection

    config = build_config({"data": {"train_batch_size": 4}, "actor_rollout_ref": {
        "actor": {"ppo_mini_batch_size": 4}, "rollout": {
        "rollout_filter_strategy": "top_k", "rollout_filter_value": 0.5, "rollout_filter_metric": "length",
        "rollout_filter_top_p_prob_mode": "softmax", "rollout_filter_selection_eps": 0.0}}})
    selection = group_selection(config.algorithm.filter_groups, config.actor_rollout_ref.rollout,
                                config.reward.overlong_buffer, config.data.train_batch_size,
                                config.data.max_response_length)
    assert (selection.ragen.group_score, selection.ragen.rollout_filter_top_p_prob_mode,
            selection.ragen.rollout_filter_selection_eps) == (
        "length", "softmax", 0.0)
    accumulator = GroupAccumulator(2, selection)
    # mean response lengths 3, 9, 6, 1: top_k 0.5 of 4 groups keeps the two longest, groups 1 and 2
    lengths = {0: [2, 4], 1: [9, 9], 2: [6, 6], 3: [1, 1]}
    accumulator.add([scored_with(tokenizer, seq, [0.0, 1.0], lengths[seq]) for seq in range(4)])
    assert [g.seq for g in accumulator.batch()] == [1, 2]


def test_overlong_penalty_shapes_scores_before_the_filter(tokenizer):
    # max 10 tokens, buffer 4: lengths 6 (no penalty), 8 (-0.5) and 10 (-1.0 with factor 1)
    overlong = OverlongBufferConfig(enable=True, len=4, penalty_factor=1.0)
    selection = GroupSelection(metric_filter=keep_varied_groups, overlong=overlong, max_response_length=10)
    accumulator = GroupAccumulator(1, selection, "score")
    # equal raw scores: only the penalty makes the group varied, so filter-groups on `score` keeps it
    accumulator.add([scored_with(tokenizer, 0, [1.0, 1.0, 1.0], lengths=[6, 8, 10])])
    assert accumulator.full
    torch.testing.assert_close(accumulator.batch()[0].scores, torch.tensor([1.0, 0.5, 0.0]))
    metrics = accumulator.metrics()
    assert metrics["overlong/reward_mean"] == pytest.approx(-0.5)
    assert metrics["overlong/frac"] == pytest.approx(2 / 3)


def test_filter_progress_prints_a_line_only_when_a_generation_batch_completes(tokenizer, caplog):
    """Generation batches of 2 prompts, 3 kept wanted: a poll that completes two batches prints one line for both,
    a poll that completes none prints nothing, the partial last batch is reported once the batch is full."""
    from megatron_cpo.trainer.driver.controller import log_filter_progress

    accumulator = GroupAccumulator(3, keep_varied_groups, "acc")
    mixed, uniform = ["4", "5"], ["4", "4"]
    polls = [[0, 1, 2, 3], [5], [4], [6, 7]]  # seq 5 finishes before seq 4: nothing new is committed by that poll
    answers = {0: mixed, 1: uniform, 2: uniform, 3: mixed, 4: uniform, 5: mixed, 6: uniform, 7: mixed}
    logged = 0
    with caplog.at_level("INFO", logger="megatron_cpo.trainer.driver.controller"):
        for seqs in polls:
            accumulator.add([scored_group(tokenizer, seq, answers[seq]) for seq in seqs])
            logged = log_filter_progress(9, accumulator, 2, logged)
    assert accumulator.full and accumulator.next_seq == 6
    assert caplog.messages == [
        "[filter_groups] step 9, gen batches 1-2: committed 4 prompts, filtered 4 trajectories, accumulated 2/3",
        "[filter_groups] step 9, gen batch 3: committed 6 prompts, filtered 6 trajectories, accumulated 3/3",
    ]
    assert logged == 3
