"""Property tests (hypothesis): group sums, sign clamp, whole-group filters, order independence."""
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_cpo.algorithms.advantages import grpo_scalar_advantages
from megatron_cpo.algorithms.cpo import ShapingInputs, difficulty_mask, shape_advantages
from megatron_cpo.algorithms.cpo_rules import SHAPING_RULES, CPOConfig
from megatron_cpo.algorithms.filters import RolloutFilterConfig, filter_groups, ragen_filter
from megatron_cpo.algorithms.groups import group_sum
from megatron_cpo.kernels import hint_mi_signals

FAST = settings(max_examples=25, deadline=None)


@st.composite
def grouped_batch(draw, max_groups=6, max_size=5, binary=False):
    """Scores, group indices (groups interleaved in a random order) and a permutation of the samples."""
    sizes = draw(st.lists(st.integers(1, max_size), min_size=1, max_size=max_groups))
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    n = int(group.numel())
    element = st.sampled_from([0.0, 1.0]) if binary else st.floats(-5, 5, allow_nan=False, width=32)
    scores = torch.tensor(draw(st.lists(element, min_size=n, max_size=n)), dtype=torch.float32)
    order = torch.tensor(draw(st.permutations(range(n))))
    perm = torch.tensor(draw(st.permutations(range(n))))
    return scores[order], group[order], perm


@FAST
@given(grouped_batch(), st.booleans())
def test_grpo_advantages_sum_to_zero_per_group(batch, norm_by_std):
    scores, group, _ = batch
    adv = grpo_scalar_advantages(scores, group, norm_by_std=norm_by_std)
    sums = group_sum(adv.double(), group)[torch.bincount(group) > 1]  # a lone response keeps its score (verl)
    assert torch.allclose(sums, torch.zeros_like(sums), atol=1e-3 * max(1.0, float(adv.abs().max())))


@FAST
@given(grouped_batch())
def test_grpo_is_independent_of_sample_order(batch):
    scores, group, perm = batch
    torch.testing.assert_close(grpo_scalar_advantages(scores[perm], group[perm]),
                               grpo_scalar_advantages(scores, group)[perm])


@FAST
@given(grouped_batch(binary=True))
def test_filter_groups_keeps_whole_groups_in_any_order(batch):
    scores, group, perm = batch
    keep = filter_groups(scores, group).keep
    for g in group.unique():  # checking the property, not computing it
        assert keep[group == g].all() or not keep[group == g].any()
    assert torch.equal(filter_groups(scores[perm], group[perm]).keep, keep[perm])


@FAST
@given(grouped_batch(binary=True), st.sampled_from(["top_p", "top_k", "min_p"]), st.floats(0.05, 1.0),
       st.sampled_from(["largest", "smallest"]), st.booleans(),
       st.sampled_from(["reward_std", "reward_mean", "reward_sum"]), st.sampled_from(["linear", "softmax"]))
def test_ragen_filters_keep_whole_groups(batch, strategy, value, filter_type, include_zero, group_score, mode):
    scores, group, perm = batch
    value = float(max(1, round(value * 4))) if strategy == "top_k" and value > 0.5 else value
    config = RolloutFilterConfig(strategy, value, filter_type, include_zero, group_score,
                                 rollout_filter_top_p_prob_mode=mode)
    keep = ragen_filter(scores, group, config).keep
    for g in group.unique():
        assert keep[group == g].all() or not keep[group == g].any()
    assert torch.equal(ragen_filter(scores[perm], group[perm], config).keep, keep[perm])
    if include_zero and (strategy in ("top_k", "min_p") or (strategy == "top_p" and mode == "softmax")):
        assert keep.any()  # linear top_p may keep nothing, as RAGEN's (the sum is never reached)


@FAST
@given(grouped_batch(), st.floats(0.01, 1.0))
def test_softmax_top_p_keeps_at_least_one_group(batch, value):
    scores, group, _ = batch
    config = RolloutFilterConfig("top_p", value, rollout_filter_top_p_prob_mode="softmax")
    assert ragen_filter(scores, group, config).keep.any()


@st.composite
def shaping_batch(draw):
    scores, group, perm = draw(grouped_batch(binary=True))
    n, t = scores.shape[0], draw(st.integers(1, 4))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2 ** 31 - 1)))
    correct = scores > 0.5
    mask = (torch.rand(n, t, generator=gen) > 0.2).long()
    adv = grpo_scalar_advantages(scores, group)[:, None] * mask
    log_probs = -3 * torch.rand(n, t, generator=gen)
    hint_log_probs = -3 * torch.rand(n, t, generator=gen)
    entropy = 2 * torch.rand(n, t, generator=gen)
    return dict(advantages=adv, entropy=entropy, mask=mask, correct=correct,
                difficulty=difficulty_mask(correct, group), log_probs=log_probs,
                hint_log_probs=hint_log_probs), perm


@FAST
@given(shaping_batch(), st.sampled_from(sorted(SHAPING_RULES)), st.floats(-3, 3), st.floats(-3, 3))
def test_shaping_sign_clamp_and_order_independence(batch, rule, pos_alpha, neg_alpha):
    inputs, perm = batch
    signals = hint_mi_signals(inputs["log_probs"], inputs["hint_log_probs"], inputs["entropy"], inputs["mask"])
    config = CPOConfig(rule, pos_alpha=pos_alpha, neg_alpha=neg_alpha, cpo_lambda=2.0)
    shaped = shape_advantages(config, ShapingInputs(signals=signals, **inputs))
    if SHAPING_RULES[rule].sign_clamp:
        assert torch.all(shaped * inputs["advantages"] >= 0)  # never the opposite sign of GRPO's
    permuted = {k: v[perm] for k, v in inputs.items()}
    permuted_signals = hint_mi_signals(permuted["log_probs"], permuted["hint_log_probs"], permuted["entropy"],
                                    permuted["mask"])
    shaped_permuted = shape_advantages(config, ShapingInputs(signals=permuted_signals, **permuted))
    torch.testing.assert_close(shaped_permuted, shaped[perm])


@FAST
@given(grouped_batch(binary=True), st.sampled_from([3, 5]))
def test_difficulty_is_per_group_and_independent_of_sample_order(batch, levels):
    scores, group, perm = batch
    correct = scores > 0.5
    difficulty = difficulty_mask(correct, group, levels=levels)
    assert torch.equal(difficulty_mask(correct[perm], group[perm], levels=levels), difficulty[perm])
    for g in group.unique():  # checking the property, not computing it
        assert difficulty[group == g].unique().numel() == 1
