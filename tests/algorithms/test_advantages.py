"""GRPO / Dr.GRPO group advantages on hand-computed cases."""
import math

import pytest
import torch

from megatron_cpo.algorithms.advantages import grpo_advantages, grpo_scalar_advantages

# group 0: scores 1,0,0,1 (mean 0.5, unbiased std sqrt(1/3)); group 1: a single response (verl's baseline 0 and
# std 1: its score passes through); group 2: 3,1,2 (std 1)
SCORES = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 3.0, 1.0, 2.0])
GROUP = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])


def test_grpo_hand_computed():
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    b = 1.0 / (1.0 + 1e-6)
    expected = torch.tensor([a, -a, -a, a, 2.0 / (1.0 + 1e-6), b, -b, 0.0])
    torch.testing.assert_close(grpo_scalar_advantages(SCORES, GROUP), expected)


def test_dr_grpo_skips_the_std():
    expected = torch.tensor([0.5, -0.5, -0.5, 0.5, 2.0, 1.0, -1.0, 0.0])
    torch.testing.assert_close(grpo_scalar_advantages(SCORES, GROUP, norm_by_std=False), expected)


def test_constant_group_gets_zero():
    adv = grpo_scalar_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    torch.testing.assert_close(adv, torch.zeros(3))


def test_token_broadcast_uses_the_mask():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = grpo_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), mask, norm_by_std=False)
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.5, 0.0], [-0.5, 0.0, 0.0]]))


def test_interleaved_groups_equal_sorted_groups():
    perm = torch.tensor([5, 0, 7, 2, 4, 1, 6, 3])
    torch.testing.assert_close(grpo_scalar_advantages(SCORES[perm], GROUP[perm]),
                               grpo_scalar_advantages(SCORES, GROUP)[perm])


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="group has shape"):
        grpo_scalar_advantages(SCORES, GROUP[:3])
    with pytest.raises(ValueError, match="negative index"):
        grpo_scalar_advantages(SCORES[:2], torch.tensor([0, -1]))
    with pytest.raises(ValueError, match="dtype"):
        grpo_scalar_advantages(SCORES[:2], torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="response_mask has shape"):
        grpo_advantages(SCORES, GROUP, torch.ones(3, 4))
