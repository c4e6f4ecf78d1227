"""Context parallelism's row split (Megatron's load-balanced chunks) and its way back, on the index level."""
import pytest
import torch

from megatron_cpo.trainer.batch.context_parallel import chunk_index


def test_each_rank_holds_chunk_r_and_its_mirror():
    assert chunk_index(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert chunk_index(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert chunk_index(12, 3, 1).tolist() == [2, 3, 8, 9]


def test_the_ranks_cover_the_row_once_and_gather_back_in_order():
    order = torch.cat([chunk_index(12, 3, rank) for rank in range(3)])
    assert sorted(order.tolist()) == list(range(12))
    row = torch.arange(12) * 10
    gathered = torch.cat([row[chunk_index(12, 3, rank)] for rank in range(3)])  # what all_gather concatenates
    assert torch.equal(gathered[torch.argsort(order)], row)


def test_a_row_that_cannot_be_split_names_the_multiple():
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        chunk_index(10, 2, 0)
