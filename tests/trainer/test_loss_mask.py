"""The episodes' loss mask in the trainer: it travels with the groups and the step batch as ragged rows, the response
mask (the one mask every loss, entropy, KL and mismatch term reads) multiplies it, and lengths that a policy is judged
by (DAPO's overlong penalty, RAGEN's length score) count only the tokens the model sampled."""
import pytest
import torch

from megatron_cpo.algorithms.config import OverlongBufferConfig
from megatron_cpo.algorithms.losses import PolicyLossConfig, policy_loss
from megatron_cpo.rollout.types import RolloutSample
from megatron_cpo.trainer.batch.ragged import RaggedRows
from megatron_cpo.trainer.batch.sequences import pack_sequences
from megatron_cpo.trainer.driver.accumulator import GroupAccumulator, GroupSelection, ScoredGroup, episode_fields
from megatron_cpo.trainer.driver.batching import make_step_batch

# two episodes: model tokens (mask 1) around an observation (mask 0); and a plain answer (no mask) in another group
EPISODES = [RolloutSample([5, 6, 7, 8, 9], [-1.0, -1.0, 0.0, 0.0, -1.0], "stop", False, loss_mask=[1, 1, 0, 0, 1]),
            RolloutSample([5, 6], [-1.0, -1.0], "stop", False, loss_mask=[1, 1])]


def group(seq: int, samples: list[RolloutSample]) -> ScoredGroup:
    return ScoredGroup(seq=seq, record=None, prompt_token_ids=[1, 2], response_token_ids=[s.token_ids for s in samples],
                       rollout_log_probs=[s.logprobs for s in samples],
                       truncated=torch.tensor([s.truncated for s in samples]), scores=torch.tensor([1.0, 0.0]),
                       acc=torch.tensor([1.0, 0.0]), **episode_fields(samples))


def test_the_step_batch_carries_the_mask_and_the_response_mask_multiplies_it():
    plain = group(1, [RolloutSample([3, 4, 5], [-1.0] * 3, "stop", False), RolloutSample([3], [-1.0], "stop", False)])
    assert plain.loss_mask is None and plain.episodes is None
    batch = make_step_batch([group(0, EPISODES), plain], kept_ratio=1.0)
    assert batch.loss_mask.tolist() == [[1, 1, 0, 0, 1], [1, 1], [1, 1, 1], [1]]
    assert make_step_batch([plain], 1.0).loss_mask is None
    seqs = pack_sequences(batch.prompt_ids, batch.response_ids, 0, 6, batch.loss_mask)
    assert seqs.response_mask().tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                                             [1, 0, 0, 0, 0, 0]]
    picked = seqs.select(torch.tensor([0, 3]))
    assert picked.response_mask().tolist() == [[1, 1, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0]]
    assert picked.trimmed().response_mask().tolist() == picked.response_mask().tolist()
    assert seqs.with_empty_rows(2).response_mask()[4:].sum() == 0
    with pytest.raises(ValueError, match="loss mask's rows do not match"):
        pack_sequences(batch.prompt_ids, batch.response_ids, 0, 6, RaggedRows.from_lists([[1], [1], [1], [1]]))


def test_the_loss_has_no_gradient_on_observation_tokens():
    seqs = pack_sequences([[1, 2]] * 2, [s.token_ids for s in EPISODES], 0, 5,
                          RaggedRows.from_lists([s.loss_mask for s in EPISODES]))
    mask = seqs.response_mask()
    torch.manual_seed(0)
    log_probs, entropy = torch.randn(2, 5, requires_grad=True), torch.rand(2, 5, requires_grad=True)
    old = log_probs.detach() + 0.01 * torch.randn(2, 5)  # inside the clip range: every sampled token has a gradient
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        config = PolicyLossConfig(loss_agg_mode=mode, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01,
                                  tis_imp_ratio_cap=2.0)
        loss, _ = policy_loss(log_probs, old, torch.ones(2, 5), mask, config, entropy=entropy,
                              ref_log_probs=torch.randn(2, 5), rollout_log_probs=old - 0.1)
        grads = torch.autograd.grad(loss, (log_probs, entropy))
        for grad in grads:  # the policy term, KL and TIS through log_probs; the entropy bonus through entropy
            assert (grad[mask == 0] == 0).all() and (grad[mask == 1] != 0).all(), mode


def test_overlong_and_ragen_lengths_count_sampled_tokens_only():
    episodes = group(0, EPISODES)
    assert episodes.response_lengths().tolist() == [3, 2]
    selection = GroupSelection(overlong=OverlongBufferConfig(enable=True, len=2), max_response_length=4)
    accumulator = GroupAccumulator(1, selection)
    accumulator.add([episodes])
    # 3 sampled tokens of a 4-token budget with a 2-token buffer: -0.5 (the 5 tokens with the observation would be -1.5)
    assert accumulator.batch()[0].overlong_penalty.tolist() == [-0.5, 0.0]
