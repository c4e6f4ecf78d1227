"""Scoring only the responses a rule can change through the hint (`hinted_responses`) gives the advantages of scoring
every response: bit-identical, for all 18 rules, on random batches with every difficulty level and on filter-groups
batches (mixed prompts only), whatever the other rows' hinted log-probs hold."""
import pytest
import torch

from megatron_cpo.algorithms.cpo import ShapingInputs, difficulty_mask, hinted_responses, shape_advantages
from megatron_cpo.algorithms.cpo_rules import HINT_READERS, SHAPING_RULES, CPOConfig
from megatron_cpo.kernels import hint_mi_signals

ALPHAS = [(0.05, 0.1), (1.0, 0.0), (0.0, 2.0)]


def _batch(seed: int, mixed_only: bool, prompts: int = 12, n: int = 4, width: int = 9):
    generator = torch.Generator().manual_seed(seed)
    rows = prompts * n
    group = torch.arange(prompts).repeat_interleave(n)
    # per prompt a success rate: 0 and 1 give all-wrong / all-correct prompts unless only mixed ones are kept
    rate = torch.rand(prompts, generator=generator)
    rate = torch.where(torch.rand(prompts, generator=generator) < 0.4, (rate > 0.5).float(), rate)
    correct = torch.rand(rows, generator=generator) < rate[group]
    if mixed_only:  # filter-groups: every kept prompt has a right and a wrong response
        correct = correct.view(prompts, n).clone()
        correct[:, 0], correct[:, 1] = True, False
        correct = correct.view(-1)
    lengths = torch.randint(1, width + 1, (rows,), generator=generator)
    mask = torch.arange(width)[None, :] < lengths[:, None]
    log_probs = -torch.rand(rows, width, generator=generator) * 4
    hint_log_probs = -torch.rand(rows, width, generator=generator) * 4
    entropy = torch.rand(rows, width, generator=generator) * 3
    advantages = torch.randn(rows, 1, generator=generator).expand(rows, width).clone()
    return dict(advantages=advantages, entropy=entropy, mask=mask, correct=correct, group=group,
                log_probs=log_probs, hint_log_probs=hint_log_probs,
                hint_correct=torch.rand(rows, generator=generator) < 0.5)


def _shape(rule, batch, hint_log_probs, pos_alpha, neg_alpha, hint_correct):
    difficulty = difficulty_mask(batch["correct"], batch["group"])
    signals = hint_mi_signals(batch["log_probs"], hint_log_probs, batch["entropy"], batch["mask"])
    inputs = ShapingInputs(batch["advantages"], batch["mask"], batch["log_probs"], batch["entropy"], hint_log_probs,
                           signals, batch["correct"], difficulty, hint_correct)
    return shape_advantages(CPOConfig(rule, pos_alpha=pos_alpha, neg_alpha=neg_alpha, cpo_lambda=5.0), inputs)


@pytest.mark.parametrize("rule", sorted(SHAPING_RULES))
@pytest.mark.parametrize("mixed_only", [False, True], ids=["all_levels", "filter_groups"])
def test_scoring_only_the_hinted_responses_gives_identical_advantages(rule, mixed_only):
    for seed in range(2):
        batch = _batch(seed, mixed_only)
        difficulty = difficulty_mask(batch["correct"], batch["group"])
        for pos_alpha, neg_alpha in ALPHAS:
            for hint_correct in (None, batch["hint_correct"]):
                full = _shape(rule, batch, batch["hint_log_probs"], pos_alpha, neg_alpha, hint_correct)
                hinted = hinted_responses(rule, batch["correct"], difficulty, pos_alpha, neg_alpha, hint_correct)
                # what the trainer does: the plain log-probs where a response is not scored under its hint
                plain = torch.where(hinted[:, None], batch["hint_log_probs"], batch["log_probs"])
                assert torch.equal(_shape(rule, batch, plain, pos_alpha, neg_alpha, hint_correct), full)
                # and any other value there: the rule never reads those rows' hinted log-probs
                garbage = torch.where(hinted[:, None], batch["hint_log_probs"], torch.randn_like(plain) * 50)
                assert torch.equal(_shape(rule, batch, garbage, pos_alpha, neg_alpha, hint_correct), full)


@pytest.mark.parametrize("rule", sorted(SHAPING_RULES))
def test_every_hinted_response_can_be_changed_by_its_hint(rule):
    """The selection is not wider than the rule's hint terms: where it is empty, no term reads a hint; a rule whose
    terms read one selects some responses on a batch with every difficulty level."""
    batch = _batch(0, mixed_only=False)
    difficulty = difficulty_mask(batch["correct"], batch["group"])
    hinted = hinted_responses(rule, batch["correct"], difficulty, 0.05, 0.1)
    reads = any(t.reads_hint for t in SHAPING_RULES[rule].terms)
    assert bool(hinted.any()) == reads
    if reads:  # moving the hinted rows' hint moves some advantage
        moved = torch.where(hinted[:, None], batch["hint_log_probs"] - 1.5, batch["log_probs"])
        full = _shape(rule, batch, torch.where(hinted[:, None], batch["hint_log_probs"], batch["log_probs"]),
                      0.05, 0.1, None)
        assert not torch.equal(_shape(rule, batch, moved, 0.05, 0.1, None), full)


def test_negonly_mi3_reads_no_hint_on_filter_groups_batches():
    """`negonly_mi3`'s hint term selects wrong responses of all-wrong prompts, which filter-groups never keeps: on
    such batches CPO is the `pos_alpha * u` bonus on correct responses, and no response is scored under its hint."""
    batch = _batch(1, mixed_only=True)
    difficulty = difficulty_mask(batch["correct"], batch["group"])
    assert not hinted_responses("negonly_mi3", batch["correct"], difficulty, 0.05, 0.1).any()
    mixed = _batch(1, mixed_only=False)
    all_wrong = difficulty_mask(mixed["correct"], mixed["group"]) == -1
    assert torch.equal(hinted_responses("negonly_mi3", mixed["correct"], difficulty_mask(mixed["correct"],
                                                                                          mixed["group"]), 0.05, 0.1),
                       all_wrong & ~mixed["correct"])
    assert {"mi", "mi_neg", "mi_nonneg", "s"} <= HINT_READERS
