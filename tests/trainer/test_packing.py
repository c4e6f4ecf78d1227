"""Padding-free packing: where the sequences of a micro-batch land in the packed rows, and the way back."""
import torch

from megatron_cpo.trainer.batch.packing import first_fit_rows, pack_rows
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, pack_sequences


def _seqs():
    # lengths (prompt + response): 5, 5, 2, 3
    return pack_sequences([[5, 6, 7], [8], [9, 10], [11]], [[1, 2], [3, 4, 5, 6], [], [12, 13]], 0, 4)


def test_first_fit_puts_the_longest_first_and_fills_gaps():
    assert first_fit_rows([5, 5, 2, 3], 5) == [[0], [1], [3, 2]]
    assert first_fit_rows([4, 1, 3, 2], 4) == [[0], [2, 1], [3]]


def test_rows_restart_positions_and_keep_each_sequence_whole():
    packed = pack_rows(_seqs())
    assert packed.tokens.tolist() == [[5, 6, 7, 1, 2], [8, 3, 4, 5, 6], [11, 12, 13, 9, 10]]
    assert packed.positions.tolist() == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4], [0, 1, 2, 0, 1]]
    assert packed.segments.tolist() == [[0] * 5, [1] * 5, [3, 3, 3, 2, 2]]
    # response token j of a sequence is predicted at its start + prompt length - 1 + j
    assert packed.targets.tolist() == [[IGNORE_INDEX, IGNORE_INDEX, 1, 2, IGNORE_INDEX], [3, 4, 5, 6, IGNORE_INDEX],
                                       [12, 13, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    mask = packed.attention_mask()[2, 0]
    allowed = [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    assert (~mask).int().tolist() == allowed


def test_to_response_matches_the_padded_layout():
    seqs = _seqs()
    packed = pack_rows(seqs)
    # a per-position value that says which token it predicts: the target itself
    assert torch.equal(packed.to_response(packed.targets.float()), seqs.to_response(seqs.targets.float()))
    assert packed.to_response(packed.targets.float()).tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [0] * 4, [12, 13, 0, 0]]


def test_thd_is_one_row_with_the_tail_as_one_more_sequence():
    packed = pack_rows(_seqs(), "thd", multiple=4)
    assert packed.tokens.shape == (1, 16) and packed.tokens[0, 15] == 0
    params = packed.packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q.tolist() == [0, 5, 10, 12, 15, 16]
    assert params.max_seqlen_q == 5
    assert packed.to_response(packed.targets.float()).tolist() == [[1, 2, 0, 0], [3, 4, 5, 6], [0] * 4, [12, 13, 0, 0]]
