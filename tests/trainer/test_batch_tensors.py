"""The step batch as flat tensors: ragged rows, vectorised packing and the tensor broadcast (two gloo processes)."""
import pytest
import torch

from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.batch.sequences import IGNORE_INDEX, pack_sequences
from tests.multiprocess import run_processes

IGN = IGNORE_INDEX


def test_ragged_rows_round_trip_and_pad():
    rows = RaggedRows.from_lists([[5, 6, 7], [], [8]])
    assert rows.values.tolist() == [5, 6, 7, 8] and rows.offsets.tolist() == [0, 3, 3, 4]
    assert rows.tolist() == [[5, 6, 7], [], [8]] and rows.lengths().tolist() == [3, 0, 1]
    assert rows.padded(3, -1).tolist() == [[5, 6, 7], [-1, -1, -1], [8, -1, -1]]
    assert rows.select(torch.tensor([2, 0])).tolist() == [[8], [5, 6, 7]]
    log_probs = RaggedRows.from_lists([[-0.5], [-1.0, -2.0]], torch.float32)
    assert log_probs.values.dtype == torch.float32 and log_probs.padded(3).tolist() == [[-0.5, 0, 0], [-1, -2, 0]]
    joined = RaggedRows.cat([rows, RaggedRows.from_lists([[9, 10]]), RaggedRows.from_lists([[]])])
    assert joined.tolist() == [[5, 6, 7], [], [8], [9, 10], []] and joined.offsets.tolist() == [0, 3, 3, 4, 6, 6]
    assert rows.repeat_rows([2, 1, 0]).tolist() == [[5, 6, 7], [5, 6, 7], []]


def test_pack_sequences_places_tokens_and_targets():
    seqs = pack_sequences([[1, 2], [3]], [[7, 8], []], pad_token_id=0, response_width=3)
    assert seqs.tokens.tolist() == [[1, 2, 7, 8], [3, 0, 0, 0]]
    # response token j of row b is predicted at position prompt_len[b] + j - 1
    assert seqs.targets.tolist() == [[IGN, 7, 8, IGN], [IGN, IGN, IGN, IGN]]
    assert seqs.prompt_lengths.tolist() == [2, 1] and seqs.response_lengths.tolist() == [2, 0]
    padded = seqs.with_empty_rows(1).select(slice(1, 3))
    assert padded.tokens.tolist() == [[3, 0, 0, 0], [0, 0, 0, 0]] and padded.targets.tolist() == [[IGN] * 4] * 2
    assert padded.response_lengths.tolist() == [0, 0] and padded.trimmed().length == 1
    same = pack_sequences(RaggedRows.from_lists([[1, 2], [3]]), RaggedRows.from_lists([[7, 8], []]), 0, 3)
    assert torch.equal(same.tokens, seqs.tokens) and torch.equal(same.targets, seqs.targets)


def test_pack_sequences_errors_name_the_fix():
    with pytest.raises(ValueError, match="data.max_response_length"):
        pack_sequences([[1]], [[2, 3]], 0, 1)
    with pytest.raises(ValueError, match="every prompt needs >= 1 token"):
        pack_sequences([[]], [[2]], 0, 4)


def _round_trip(rank, world_size):
    from megatron_cpo import platform
    from megatron_cpo.trainer.batch.step_batch import StepBatch
    from megatron_cpo.trainer.collectives import broadcast_batch

    platform.init_distributed(1, 1, seed=1)
    batch = None
    if rank == 0:
        batch = StepBatch([[1, 2], [1, 2], [3]], [[4], [5, 6], []], [[-0.25], [-0.5, -1.5], []],
                          torch.tensor([1.0, 0.0, 1.0]), torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 0, 1]),
                          torch.tensor([False, True, False]), 0.5, hint_prompt_ids=[[2**33, 1, 2], [1, 2], [3]],
                          has_hint=torch.tensor([True, False, False]), hints_truncated=1)
    got = broadcast_batch(batch)
    stop = broadcast_batch(None)
    platform.destroy_distributed()
    return {"prompts": got.prompt_ids.tolist(), "responses": got.response_ids.tolist(),
            "log_probs": got.rollout_log_probs.tolist(), "truncated": got.truncated.tolist(),
            "group": got.group.tolist(), "kept_ratio": got.kept_ratio, "hints": got.hint_prompt_ids.tolist(),
            "has_hint": got.has_hint.tolist(), "hints_truncated": got.hints_truncated, "stop": stop,
            "dtypes": {str(got.prompt_ids.values.dtype), str(got.hint_prompt_ids.values.dtype)}}


def test_broadcast_batch_sends_tensors_that_rebuild_the_batch():
    """Token ids travel as int32 when they fit; a value that does not (2**33 here) sends its tensor as int64."""
    for result in run_processes(_round_trip, 2):
        assert result == {"prompts": [[1, 2], [1, 2], [3]], "responses": [[4], [5, 6], []],
                          "log_probs": [[-0.25], [-0.5, -1.5], []], "truncated": [False, True, False],
                          "group": [0, 0, 1], "kept_ratio": 0.5, "hints": [[2**33, 1, 2], [1, 2], [3]],
                          "has_hint": [True, False, False], "hints_truncated": 1, "stop": None,
                          "dtypes": {"torch.int64"}}
