"""`SampleBudget`: rank 0's count of generated samples against `trainer.total_rollout_samples` and
`trainer.test_freq_samples`, and the settings' checks."""
import pytest

from megatron_cpo.config import build_config
from megatron_cpo.trainer.driver.sample_budget import SampleBudget


def test_validation_falls_after_each_step_that_crosses_a_multiple_and_the_budget_ends_the_run():
    budget = SampleBudget(total=700, test_freq=320)
    # DAPO-like steps: 1-4 generation batches of 64 samples each
    due = [budget.add(samples) for samples in (256, 64, 192, 128, 64)]
    assert due == [False, True, False, True, False] and budget.generated == 704 and budget.spent
    resumed = SampleBudget(total=700, test_freq=320)
    resumed.load_state_dict(budget.state_dict())
    assert resumed.generated == 704 and resumed.spent
    off = SampleBudget(total=0, test_freq=0)
    assert not off.add(10_000) and not off.spent


def test_the_settings_are_checked():
    trainer = build_config({}, ["trainer.total_rollout_samples=2560", "trainer.test_freq_samples=320",
                                "trainer.max_actor_ckpt_to_keep=1"]).trainer
    assert (trainer.total_rollout_samples, trainer.test_freq_samples, trainer.max_actor_ckpt_to_keep) == (2560, 320, 1)
    with pytest.raises(ValueError, match="trainer.test_freq_samples=-1 must be >= 0"):
        build_config({}, ["trainer.test_freq_samples=-1"])
    with pytest.raises(ValueError, match="trainer.max_actor_ckpt_to_keep=0 must be >= 1"):
        build_config({}, ["trainer.max_actor_ckpt_to_keep=0"])
