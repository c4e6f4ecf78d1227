"""The advantage shapers `algorithm.adv_estimator` selects: GRPO leaves the advantages alone and needs no hints; CPO
asks for hint contexts and applies its rule with `algorithm.cpo.*` (the seed's keys are aliases)."""
from dataclasses import replace

import pytest
import torch

from megatron_cpo.algorithms.cpo import ShapingInputs
from megatron_cpo.algorithms.shapers import CPOConfig, CPOShaper, build_shaper
from megatron_cpo.config import build_config
from tests.algorithms.test_cpo import EXPECTED, _batch


def _inputs(shaper):
    batch = _batch()  # r0, r1 share a mixed group; r2 is an all-wrong group, r3 an all-correct one
    responses = shaper.response_inputs(batch["correct"], torch.tensor([0, 0, 1, 2]))
    return ShapingInputs(batch["advantages"], batch["mask"], batch["log_probs"], batch["entropy"],
                         batch["hint_log_probs"], batch["signals"], responses.correct, responses.difficulty)


def test_grpo_keeps_the_advantages_and_needs_no_hints():
    shaper = build_shaper("grpo", CPOConfig())
    inputs = _inputs(shaper)
    assert not shaper.needs_hint_contexts
    shaped = shaper.shape(inputs)
    assert shaped is inputs.advantages and shaper.metrics(inputs, shaped) == {}


def test_cpo_applies_its_rule_with_the_configured_weights():
    shaper = build_shaper("cpo", CPOConfig(wrap_method="negonly_mi3", pos_alpha=1.0, neg_alpha=2.0, cpo_lambda=2.0))
    inputs = _inputs(shaper)
    assert isinstance(shaper, CPOShaper) and shaper.needs_hint_contexts
    shaped = shaper.shape(inputs)
    metrics = shaper.metrics(inputs, shaped)
    torch.testing.assert_close(shaped, torch.tensor(EXPECTED["negonly_mi3_qwen3"]))
    # one response of four in each of: all wrong (r2), all correct (r3); two in the mixed group
    assert (metrics["cpo/difficulty_all_wrong"], metrics["cpo/difficulty_mixed"],
            metrics["cpo/difficulty_all_correct"]) == (0.25, 0.5, 0.25)
    assert metrics["cpo/mi_positive_ratio"] == pytest.approx(4 / 7)  # 7 unmasked tokens, token 0 has mi = 0.5
    with pytest.raises(ValueError, match="needs hint_log_probs"):
        shaper.shape(replace(inputs, signals=None))


def test_cpo_settings_under_algorithm_cpo_and_the_seed_keys_as_aliases():
    seed = build_config({"algorithm": {"adv_estimator": "cpo", "wrap_method": "mi3", "gold_as_hint": False},
                         "actor_rollout_ref": {"actor": {"cpo_lambda": 3.0, "pos_alpha": 0.5, "neg_alpha": 0.25}}})
    ours = build_config({}, ["algorithm.adv_estimator=cpo", "algorithm.cpo.wrap_method=mi3",
                             "algorithm.cpo.gold_as_hint=false", "algorithm.cpo.cpo_lambda=3",
                             "algorithm.cpo.pos_alpha=0.5", "algorithm.cpo.neg_alpha=0.25"])
    assert seed.algorithm.cpo == ours.algorithm.cpo == CPOConfig("mi3", False, 3.0, 0.5, 0.25)
    assert seed.algorithm.shaper.needs_hint_contexts and not build_config({}).algorithm.shaper.needs_hint_contexts
    with pytest.raises(ValueError, match="algorithm.cpo.cpo_lambda=0.5 must be >= 1"):
        build_config({}, ["actor_rollout_ref.actor.cpo_lambda=0.5"])


def test_cpo_shapes_the_advantages_of_a_group_estimator_and_refuses_the_others():
    default = build_config({}, ["algorithm.adv_estimator=cpo"]).algorithm
    assert default.estimator_name == "grpo" and isinstance(default.shaper, CPOShaper)
    for base, name in (("rloo", "rloo"), ("rloo_vectorized", "rloo"),
                       ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline")):
        algorithm = build_config({}, ["algorithm.adv_estimator=cpo", f"algorithm.cpo.base_estimator={base}"]).algorithm
        assert algorithm.estimator_name == name and isinstance(algorithm.shaper, CPOShaper)
    plain = build_config({}, ["algorithm.adv_estimator=rloo"]).algorithm
    assert plain.estimator_name == "rloo" and not plain.shaper.needs_hint_contexts
    for base in ("remax", "reinforce_plus_plus", "gae", "opo"):
        with pytest.raises(ValueError, match=f"algorithm.cpo.base_estimator='{base}' cannot carry CPO's shaping: "
                                             "the rule reads each prompt group's difficulty; choose grpo, rloo or "
                                             "reinforce_plus_plus_baseline"):
            build_config({}, ["algorithm.adv_estimator=cpo", f"algorithm.cpo.base_estimator={base}"])


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.adv_estimator=rloo", "actor_rollout_ref.rollout.n=1"],
     "actor_rollout_ref.rollout.n=1 cannot form groups for rloo advantages"),
    (["algorithm.adv_estimator=remax", "async_training.max_staleness=1"],
     "algorithm.adv_estimator=remax with async_training.max_staleness=1: the greedy baseline answers are generated "
     "with the synchronous loop's batches only"),
    (["algorithm.gamma=1.5"], "algorithm.gamma=1.5 must be in [0, 1]"),
])
def test_estimators_that_cannot_run_are_refused_at_load(overrides, message):
    with pytest.raises(ValueError) as err:
        build_config({}, overrides)
    assert message in str(err.value)


def test_estimators_without_groups_take_one_response_per_prompt():
    for name in ("remax", "reinforce_plus_plus"):
        config = build_config({}, [f"algorithm.adv_estimator={name}", "actor_rollout_ref.rollout.n=1"])
        assert config.actor_rollout_ref.rollout.n == 1
