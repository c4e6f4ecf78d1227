"""Filter-and-accumulate on scored groups built from real tokenizer output: order, filtering, truncation, rewind."""
import pytest
import torch

from megatron_cpo.models.tiny import build_char_tokenizer
from megatron_cpo.trainer.accumulator import GroupAccumulator, ScoredGroup, std_positive_filter
from megatron_cpo.trainer.prompt_stream import PromptStream


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
    acc = GroupAccumulator(2, std_positive_filter, "acc")
    mixed, all_right, all_wrong, mixed2, mixed3 = (["4", "5"], ["4", "4"], ["3", "5"], ["5", "4"], ["4", "1"])
    acc.add([scored_group(tokenizer, 1, all_right), scored_group(tokenizer, 2, all_wrong)])
    assert acc.next_seq == 0 and not acc.kept  # seq 0 has not finished: nothing is committed out of order
    acc.add([scored_group(tokenizer, 0, mixed), scored_group(tokenizer, 4, mixed3)])
    assert acc.next_seq == 3 and len(acc.kept) == 1 and not acc.full
    acc.add([scored_group(tokenizer, 3, mixed2)])
    assert acc.full
    assert [g.seq for g in acc.batch()] == [0, 3]
    assert acc.next_seq == 4  # seq 4 finished but is not used: it goes back to the data stream
    metrics = acc.metrics()
    assert metrics["filter/filtered_prompts"] == 2
    assert metrics["filter/filtered_all_correct"] == 1 and metrics["filter/filtered_all_wrong"] == 1
    assert metrics["filter/filter_rate"] == pytest.approx(0.5)
    assert acc.stats.filtered_trajectories == 4


def test_without_filter_every_group_is_kept(tokenizer):
    acc = GroupAccumulator(3)
    acc.add([scored_group(tokenizer, i, ["4", "4"]) for i in range(5)])
    assert [g.seq for g in acc.batch()] == [0, 1, 2] and acc.next_seq == 3


def test_duplicate_groups_are_rejected(tokenizer):
    acc = GroupAccumulator(3)
    acc.add([scored_group(tokenizer, 0, ["4", "5"])])
    with pytest.raises(ValueError, match="already added"):
        acc.add([scored_group(tokenizer, 0, ["4", "5"])])


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
