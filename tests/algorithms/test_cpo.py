"""CPO: signals, difficulty mask and every shaping rule on hand-computed cases (docs/cpo.md)."""
import math

import pytest
import torch

from megatron_cpo.algorithms.cpo import ShapingInputs, difficulty_mask, shape_advantages, shaping_metrics
from megatron_cpo.algorithms.cpo_rules import SHAPING_RULES, CPOConfig, known_rules, resolve_rule
from megatron_cpo.kernels import HintSignals, hint_mi_signals

LN2 = math.log(2.0)


def test_hint_signals_hand_computed():
    pad = float("-inf")
    log_probs = torch.tensor([[math.log(0.5), math.log(0.25), math.log(0.25), 0.0],
                              [0.0, 0.0, 0.0, 0.0],
                              [math.log(0.5), 0.0, 0.0, 0.0]])
    hint_log_probs = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5), pad],
                                   [pad, pad, pad, pad],
                                   [math.log(0.25), pad, pad, pad]])
    entropy = torch.tensor([[1.0, 3.0, 2.0, 100.0], [7.0, 7.0, 7.0, 7.0], [5.0, 100.0, 100.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]])
    sig = hint_mi_signals(log_probs, hint_log_probs, entropy, mask)
    on = mask.bool()  # mi and kl are defined at every position; shaping reads them through the mask only
    torch.testing.assert_close(sig.kl[on], torch.tensor([0.0, LN2, LN2, -LN2]))
    torch.testing.assert_close(sig.mi[on], torch.tensor([0.0, 0.5 * LN2, 0.5 * LN2, -0.25 * LN2]))
    torch.testing.assert_close(sig.u, torch.tensor([[0.0, 1.0, 0.5, 0.0], [0.0] * 4, [0.0] * 4]))
    torch.testing.assert_close(sig.ubar, torch.tensor([2.0, 0.0, 5.0]))
    torch.testing.assert_close(sig.s, torch.tensor([2 * LN2 / 3, 0.0, -LN2]))


def test_difficulty_three_levels():
    correct = torch.tensor([True, True, False, False, False, True, False, True])
    group = torch.tensor([0, 0, 1, 1, 2, 2, 2, 3])
    assert difficulty_mask(correct, group).tolist() == [1, 1, -1, -1, 0, 0, 0, 1]


def test_difficulty_five_levels():
    # five groups of four rollouts with 0, 1, 2, 3, 4 correct
    counts = [0, 1, 2, 3, 4]
    correct = torch.tensor([i < c for c in counts for i in range(4)])
    group = torch.arange(5).repeat_interleave(4)
    expected = [level for level in (-2, -1, 0, 1, 2) for _ in range(4)]
    assert difficulty_mask(correct, group, levels=5).tolist() == expected
    with pytest.raises(ValueError, match="levels=4"):
        difficulty_mask(correct, group, levels=4)


# The shared batch of the rule table. Rows: r0 correct in a mixed group (A=1), r1 wrong in the same mixed group
# (A=-1), r2 wrong in an all-wrong group (A=-0.5), r3 correct in an all-correct group (A=0.5), whose 2nd token is
# padding holding 9.0 (must stay). Token 0: mi=0.5, kl=0.2, u=0.25, H=2 (gap 0), the hint raises p from 0.2 to 0.8.
# Token 1: mi=-0.5, kl=-0.2, u=0.5, H=1 (gap 1), the hint lowers p from 0.8 to 0.2. pos_alpha=1, neg_alpha=2, lam=2.
def _batch(**overrides):
    batch = dict(
        advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0], [-0.5, -0.5], [0.5, 9.0]]),
        signals=HintSignals(
            mi=torch.tensor([[0.5, -0.5]] * 4), kl=torch.tensor([[0.2, -0.2]] * 4),
            u=torch.tensor([[0.25, 0.5]] * 4), ubar=torch.tensor([0.8, 0.8, 0.8, 0.3]),
            s=torch.tensor([0.2, 0.4, -0.25, 0.1]),
        ),
        entropy=torch.tensor([[2.0, 1.0]] * 4),
        mask=torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0]]),
        correct=torch.tensor([True, False, False, True]),
        difficulty=torch.tensor([0, 0, -1, 1]),
        log_probs=torch.log(torch.tensor([[0.2, 0.8]] * 4)),
        hint_log_probs=torch.log(torch.tensor([[0.8, 0.2]] * 4)),
        pos_alpha=1.0, neg_alpha=2.0, cpo_lambda=2.0,
    )
    batch.update(overrides)
    return batch


def _shape(rule, pos_alpha, neg_alpha, cpo_lambda, **tensors):
    """CPO's `rule` with these weights on tensors named as `ShapingInputs`' fields: (shaped advantages, metrics)."""
    inputs = ShapingInputs(**tensors)
    shaped = shape_advantages(CPOConfig(rule, pos_alpha=pos_alpha, neg_alpha=neg_alpha, cpo_lambda=cpo_lambda), inputs)
    return shaped, shaping_metrics(inputs, shaped)


EXPECTED = {
    "naive": [[3.0, -1.0], [1.0, -3.0], [1.5, -2.5], [2.5, 9.0]],
    "naive_qwen3": [[3.0, 1.0], [-1.0, -3.0], [-0.5, -2.5], [2.5, 9.0]],
    "noaccmask_qwen3": [[3.0, 0.0], [0.0, -3.0], [0.0, -2.5], [2.5, 9.0]],
    "mi_qwen3": [[1.125, 0.5], [-0.875, -1.5], [-0.375, -1.0], [0.625, 9.0]],
    # positive term only on correct responses where mi >= 0 (token 0: +1 * 0.5 * 1.25), negative term only on wrong
    # ones where mi < 0 (token 1: +2 * -0.5 * 1.5 = -1.5); r0's token 1 and r1's token 0 stay as GRPO gave them
    "mi_accmask_qwen3": [[1.625, 1.0], [-1.0, -2.5], [-0.5, -2.0], [1.125, 9.0]],
    "mi_unify_qwen3": [[1.375, 0.75], [-0.25, -1.5], [0.0, -1.0], [0.875, 9.0]],
    "mi_clamp_unify_qwen3": [[1.375, 0.75], [-0.25, -1.5], [0.0, -1.0], [0.875, 9.0]],
    "mi_clamp_unify_difficulty_qwen3": [[1.75, 0.5], [-0.25, -1.5], [-0.125, -0.75], [0.875, 9.0]],
    "mi3_qwen3": [[1.25, 1.5], [-0.75, -1.5], [-0.25, -1.0], [0.75, 9.0]],
    "negonly_mi3_qwen3": [[1.25, 1.5], [-1.0, -1.0], [-0.25, -1.0], [0.75, 9.0]],
    "negonly_mi_qwen3": [[1.25, 1.5], [-1.0, -1.0], [0.5, -1.5], [0.75, 9.0]],
    "reverse_mi3_qwen3": [[1.25, 1.5], [-1.25, -0.5], [-0.75, 0.0], [0.75, 9.0]],
    "addition_mi3_qwen3": [[1.25, 1.5], [-0.75, -1.0], [-0.25, -0.5], [0.75, 9.0]],
    "mi2_qwen3": [[1.25, 1.5], [0.0, -2.0], [0.5, -1.5], [0.75, 9.0]],
    "negonly_seq_kl_qwen3": [[1.2, 1.2], [-1.0, -1.0], [-1.0, -1.0], [0.6, 9.0]],
    "seq_kl_qwen3": [[1.8, 1.8], [-0.5, -0.5], [-1.0, -1.0], [0.8, 9.0]],
    "negonly_tok_kl_qwen3": [[1.25, 1.5], [-1.0, -1.0], [-0.1, -0.9], [0.75, 9.0]],
    "tok_kl_qwen3": [[1.25, 1.5], [-0.6, -1.4], [-0.1, -0.9], [0.75, 9.0]],
}


def test_every_rule_has_a_hand_computed_case():
    assert set(EXPECTED) == set(SHAPING_RULES) and len(SHAPING_RULES) == 18


@pytest.mark.parametrize("rule", sorted(EXPECTED))
def test_rule_table(rule):
    shaped, info = _shape(rule, **_batch())
    torch.testing.assert_close(shaped, torch.tensor(EXPECTED[rule]))
    assert "cpo/u_mean" in info and math.isfinite(info["cpo/adv_change_mean"])


@pytest.mark.parametrize("rule", sorted(EXPECTED))
def test_zero_alphas_change_nothing(rule):
    batch = _batch(pos_alpha=None, neg_alpha=0.0)
    shaped, _ = _shape(rule, **batch)
    base = batch["advantages"]
    if SHAPING_RULES[rule].sign_clamp:  # with both alphas off only the sign clamp can act
        base = torch.where(batch["mask"].bool(), torch.where(batch["correct"][:, None], base.clamp(min=0),
                                                             base.clamp(max=0)), base)
    torch.testing.assert_close(shaped, base)


def test_names_with_and_without_suffix():
    assert resolve_rule("negonly_mi3") is SHAPING_RULES["negonly_mi3_qwen3"]
    assert resolve_rule("naive") is SHAPING_RULES["naive"]  # the exact name wins: naive != naive_qwen3
    assert resolve_rule("naive_qwen3") is SHAPING_RULES["naive_qwen3"]
    assert len(known_rules()) == 18 + 16  # every _qwen3 name also bare; bare naive is its own rule
    with pytest.raises(ValueError, match="choose one of .*negonly_mi3"):
        _shape("mi4", **_batch())
    with pytest.raises(ValueError, match="known rules"):
        resolve_rule("bogus")


def test_mi_and_kl_are_clamped_at_ten():
    sig = HintSignals(mi=torch.tensor([[12.0, 3.0]]), kl=torch.tensor([[15.0, -15.0]]), u=torch.tensor([[0.5, 0.5]]),
                      ubar=torch.zeros(1), s=torch.zeros(1))
    common = dict(advantages=torch.tensor([[-1.0, -1.0]]), signals=sig, entropy=torch.ones(1, 2),
                  mask=torch.ones(1, 2), correct=torch.tensor([False]), difficulty=torch.tensor([-1]),
                  log_probs=torch.zeros(1, 2), hint_log_probs=torch.zeros(1, 2), pos_alpha=1.0, neg_alpha=0.1,
                  cpo_lambda=5.0)
    shaped, _ = _shape("mi_clamp_unify", **common)
    # wrong: A + 0.1 * min(mi, 10) * (1 - u) = -1 + 0.5, -1 + 0.15; clamp keeps <= 0
    torch.testing.assert_close(shaped, torch.tensor([[-0.5, -0.85]]))
    shaped, _ = _shape("negonly_tok_kl", **common)
    torch.testing.assert_close(shaped, torch.tensor([[0.0, -2.0]]))  # -1 + 0.1 * clamp(kl, -10, 10)


def test_naive_needs_confident_probabilities():
    # ratio 4 -> clamped to lam=2 but p_hint = 0.08 <= 0.1; ratio 1/4 but p = 0.08: neither condition holds
    batch = _batch(log_probs=torch.log(torch.tensor([[0.02, 0.08]] * 4)),
                   hint_log_probs=torch.log(torch.tensor([[0.08, 0.02]] * 4)))
    shaped, info = _shape("naive", **batch)
    torch.testing.assert_close(shaped, batch["advantages"])
    assert info["cpo/shaped_token_frac"] == 0.0


def test_hint_correct_gates_terms_on_wrong_responses():
    # r1 is wrong and its hinted rollout was wrong too: its mi3 terms switch off; r2 keeps them
    shaped, _ = _shape("mi3", **_batch(hint_correct=torch.tensor([True, False, True, True])))
    torch.testing.assert_close(shaped, torch.tensor([[1.25, 1.5], [-1.0, -1.0], [-0.25, -1.0], [0.75, 9.0]]))


def test_seq_kl_floor_bound_on_correct_responses():
    # a negative pos_alpha pulls correct responses down, but by at most |A|/2 outside all-correct prompts
    shaped, _ = _shape("seq_kl", **_batch(pos_alpha=-2.0, neg_alpha=0.0))
    # r0: max(-2 * 0.8, -0.5) = -0.5 -> 0.5; r3 (all correct): 0.5 - 2 * 0.3 = -0.1
    torch.testing.assert_close(shaped, torch.tensor([[0.5, 0.5], [-1.0, -1.0], [-0.5, -0.5], [-0.1, 9.0]]))


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="3-level"):
        _shape("mi3", **_batch(difficulty=torch.tensor([0, 0, -2, 2])))
    with pytest.raises(ValueError, match="entropy has shape"):
        _shape("mi3", **_batch(entropy=torch.ones(4, 3)))
    with pytest.raises(ValueError, match="cpo_lambda"):
        _shape("naive", **_batch(cpo_lambda=0.5))


def test_mi_accmask_gates_by_correctness_issue_repro():
    # issue 12 item 1: one token each, p 0.2 -> p_hint 0.8, so mi = 0.8 * ln 4 >= 0 and u = 0 (one token per row).
    # correct r0: 0.7071 + 1 * 0.8 * ln 4 * (1 + 0) = 1.8161; wrong r1: the positive term does not apply -> -0.7071.
    log_probs = torch.full((2, 1), math.log(0.2))
    hint_log_probs = torch.full((2, 1), math.log(0.8))
    entropy, mask = torch.ones(2, 1), torch.ones(2, 1)
    correct = torch.tensor([True, False])
    signals = hint_mi_signals(log_probs, hint_log_probs, entropy, mask)
    shaped, _ = _shape("mi_accmask", advantages=torch.tensor([[0.7071], [-0.7071]]), signals=signals, entropy=entropy,
                       mask=mask, correct=correct, difficulty=torch.tensor([0, 0]), log_probs=log_probs,
                       hint_log_probs=hint_log_probs, pos_alpha=1.0, neg_alpha=0.0, cpo_lambda=5.0)
    torch.testing.assert_close(shaped, torch.tensor([[0.7071 + 0.8 * math.log(4.0)], [-0.7071]]))
    assert abs(float(shaped[0, 0]) - 1.816) < 1e-3
