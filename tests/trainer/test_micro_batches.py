"""Token-budget micro-batching: balanced DP shares, budgets respected, every row exactly once, clear errors."""
import pytest
import torch

from megatron_cpo.trainer.batch.micro_batches import (
    balance_rows,
    fixed_plan,
    token_budget_micro_batches,
    token_budget_plan,
)
from megatron_cpo.trainer.batch.sequences import pack_sequences


def test_balance_rows_evens_tokens_longest_first():
    # longest first to the lightest share: 9 -> A, 7 -> B, 5 -> B (7 < 9), 4 -> A (9 < 12), 1 -> B (12 < 13)
    shares = balance_rows(torch.tensor([5, 9, 1, 7, 4]), 2)
    assert [s.tolist() for s in shares] == [[1, 4], [0, 2, 3]]


def test_token_budget_micro_batches_pad_each_to_its_own_longest_row():
    lengths = torch.tensor([10, 3, 8, 2, 2, 9])
    # budget 20: [10, 9] (2 x 10 = 20), [8, 3] (2 x 8; a third row would make 24), [2, 2]
    batches = token_budget_micro_batches(lengths, torch.arange(6), 20, "budget")
    assert [b.tolist() for b in batches] == [[0, 5], [2, 1], [3, 4]]
    assert all(len(b) * int(lengths[b].max()) <= 20 for b in batches)


def test_pipeline_depth_splits_further_when_rows_allow():
    lengths = torch.tensor([4, 4, 4, 4])
    assert len(token_budget_micro_batches(lengths, torch.arange(4), 100, "budget")) == 1
    batches = token_budget_micro_batches(lengths, torch.arange(4), 100, "budget", min_count=3)
    assert len(batches) == 3 and sorted(torch.cat(batches).tolist()) == [0, 1, 2, 3]


def test_plan_covers_every_row_once():
    lengths = torch.randint(1, 50, (37,), generator=torch.Generator().manual_seed(0))
    plan = token_budget_plan(lengths, 3, 64, "budget")
    rows = torch.cat([torch.cat(micro) for micro in plan])
    assert sorted(rows.tolist()) == list(range(37))
    assert [len(torch.cat(m)) for m in fixed_plan(12, 2, 3)] == [6, 6]


def test_a_row_longer_than_the_budget_names_both_numbers_and_the_fix():
    with pytest.raises(ValueError, match=r"sequence of 12 tokens .* ppo_max_token_len_per_gpu=10; raise "
                                         r"ppo_max_token_len_per_gpu to at least 12"):
        token_budget_micro_batches(torch.tensor([3, 12]), torch.arange(2), 10, "ppo_max_token_len_per_gpu")


def test_trimmed_sequences_keep_their_targets():
    seqs = pack_sequences([[1, 2], [3, 4, 5, 6]], [[7], [8, 9]], pad_token_id=0, response_width=4)
    short = seqs.select(torch.tensor([0])).trimmed()
    assert short.length == 3 and short.targets.tolist() == [[-100, 7, -100]]
