"""Shaping in one place (trainer/workers/shaping.py) and steps 3-5's results as values.

Shaping a batch's rows in pieces, as the micro-batches of an on-policy update do from their own forward (with the
plan's zero padding rows), and putting the pieces' columns back in row order gives what shaping the whole batch at
once gives: the advantages to train on, every term's intermediate result and records, and the step's metrics. The
values of steps 3-4 (`BatchLogProbs`, `StepAdvantages`) are frozen, and step 4 shapes before the update exactly when
the update does not (on-policy, with a term that reads the log-probs). No Megatron model is needed here: the
two-rank update itself is tests/trainer/test_on_policy_update.py.
"""
import dataclasses
from functools import partial
from operator import itemgetter

import pytest
import torch

from megatron_cpo.config import build_config
from megatron_cpo.trainer.batch.step_batch import StepBatch
from megatron_cpo.trainer.components import policy_update_config
from megatron_cpo.trainer.workers.megatron_model import with_zero_rows
from megatron_cpo.trainer.workers.policy_update import BatchLogProbs, compute_advantages, prepare_sequences
from megatron_cpo.trainer.workers.shaping import (
    LossScaleTerm,
    ResponseShaping,
    ScoredTokens,
    ShaperTerm,
    ShapingSources,
)

WIDTH = 12
BASE = ["data.train_batch_size=2", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"data.max_response_length={WIDTH}", "actor_rollout_ref.actor.filter_loss_scaling=sqrt"]
CPO = BASE + ["algorithm.adv_estimator=cpo", "algorithm.cpo.wrap_method=mi3", "algorithm.cpo.pos_alpha=1.0",
              "algorithm.cpo.neg_alpha=2.0"]


def _step(overrides):
    """Two mixed prompts of four responses (the wrong ones scored under a hint, half the groups kept), random
    log-probs / entropy / hinted log-probs, and GRPO-like advantages: the config, batch, step 3's values."""
    generator = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, WIDTH + 1, (8,), generator=generator)
    responses = [torch.randint(3, 100, (int(n),), generator=generator).tolist() for n in lengths]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0])
    config = build_config({}, overrides)
    hints = config.algorithm.shaper.needs_hint_contexts
    extra = dict(hint_prompt_ids=[[1, 20, 21, 5]] * 2 + [[1, 22, 23, 9]] * 2, has_hint=scores == 0) if hints else {}
    batch = StepBatch([[1, 5, 6]] * 4 + [[1, 9, 10]] * 4, responses, [[-4.0] * len(r) for r in responses], scores,
                      scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 0.5, **extra)
    seqs, rollout_log_probs = prepare_sequences(batch, 0, WIDTH)
    hint_log_probs = None
    if hints:
        hint_log_probs = torch.where((scores == 0)[:, None], -3 * torch.rand(8, WIDTH, generator=generator), 0.0)
    lp = BatchLogProbs(seqs, seqs.response_mask(), rollout_log_probs, -3 * torch.rand(8, WIDTH, generator=generator),
                       2 * torch.rand(8, WIDTH, generator=generator), None, hint_log_probs)
    return config, batch, lp


def _shaping(overrides):
    config, batch, lp = _step(overrides)
    shaping = ResponseShaping.of_step(ShapingSources(batch, lp.hint_log_probs, config.algorithm,
                                                     config.actor_rollout_ref.actor))
    estimated = torch.randn(8, 1, generator=torch.Generator().manual_seed(1)) * lp.mask
    return shaping, estimated, ScoredTokens(lp.mask, lp.old_log_probs, lp.entropy)


def test_the_terms_of_a_step():
    cpo, grpo = _shaping(CPO)[0], _shaping(BASE)[0]
    assert [type(term) for term in cpo.terms] == [ShaperTerm, LossScaleTerm] and cpo.reads_log_probs
    assert [type(term) for term in grpo.terms] == [LossScaleTerm] and not grpo.reads_log_probs
    assert cpo.column_count == 2 + 5 and grpo.column_count == 1  # each term's result, and CPO's five hint signals


@pytest.mark.parametrize("overrides", [CPO, BASE], ids=["cpo", "grpo"])
def test_shaping_micro_batches_gives_the_whole_batch_shaping(overrides):
    shaping, estimated, tokens = _shaping(overrides)
    whole = shaping.shape(estimated, tokens)
    padded_rows = 9  # one empty row, as a plan pads the batch to its micro-batches
    pad = partial(with_zero_rows, rows=padded_rows)
    padded_shaping = shaping.map_rows(pad)
    padded_tokens = ScoredTokens(*map(pad, (tokens.mask, tokens.log_probs, tokens.entropy)))
    gathered = torch.zeros(shaping.column_count, padded_rows, WIDTH)
    for rows in (torch.tensor([0, 5, 2]), torch.tensor([7, 1]), torch.tensor([3, 8, 4, 6])):
        take = itemgetter(rows)
        piece = padded_shaping.map_rows(take).shape(
            take(pad(estimated)), ScoredTokens(*map(take, (padded_tokens.mask, padded_tokens.log_probs,
                                                           padded_tokens.entropy))))
        gathered[:, rows] = torch.stack(padded_shaping.columns(piece))
    shaped = shaping.from_columns(estimated, tuple(gathered[:, :8]))
    for got, expected in zip(shaping.columns(shaped), shaping.columns(whole), strict=True):
        torch.testing.assert_close(got, expected)
    metrics = shaping.metrics(shaped, tokens)
    assert metrics == pytest.approx(shaping.metrics(whole, tokens))
    assert metrics["filter/loss_scale"] == 0.5 ** 0.5
    if overrides is CPO:  # the rule moved the wrong responses' advantages, and the loss scale all of them
        assert metrics["cpo/shaped_token_frac"] > 0 and metrics["cpo/hinted_frac"] == 0.5
        assert not torch.equal(shaped.steps[1], estimated)
    torch.testing.assert_close(shaped.advantages, shaped.steps[-2] * 0.5 ** 0.5)


def test_step_values_are_frozen_and_shaped_before_the_update_only_when_the_update_does_not():
    config, batch, lp = _step(CPO)
    settings = policy_update_config(config)
    advantages, metrics = compute_advantages(batch, lp, settings)
    shaping, estimated, tokens = _shaping(CPO)
    expected = advantages.shaping.shape(advantages.estimated, tokens)
    assert advantages.shaped is not None and torch.equal(advantages.shaped.advantages, expected.advantages)
    assert metrics["cpo/shaped_token_frac"] > 0
    # on-policy: step 3 left the old log-probs to the update, which shapes each micro-batch from them
    on_policy = dataclasses.replace(lp, old_log_probs=None, entropy=None)
    deferred, metrics = compute_advantages(batch, on_policy, settings)
    assert deferred.shaped is None and torch.equal(deferred.estimated, advantages.estimated)
    assert "cpo/shaped_token_frac" not in metrics  # the update reports it, from what it trained on
    for value, field in ((lp, "old_log_probs"), (advantages, "estimated"), (advantages.shaped, "steps")):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(value, field, None)
