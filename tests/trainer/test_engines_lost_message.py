"""The line a run ends with when its engines are lost: what cannot be done, what was kept, how to go on."""
from pathlib import Path

from megatron_cpo.trainer.run.run_guards import engines_lost_message

CHECKPOINT = Path("/runs/x/checkpoints/step_000011")


def test_a_step_that_cannot_be_generated_is_resumed_the_last_steps_lost_validation_is_run_by_eval():
    middle = engines_lost_message("engine 0: dead", (0, 2), 11, CHECKPOINT)
    assert middle.startswith("no rollout engine is left (2 started; last failure: engine 0: dead), so step 12 cannot "
                             "be generated;")
    assert f"the 11 trained steps are in checkpoint {CHECKPOINT}" in middle and middle.endswith("trainer.resume=auto")
    # after the last step nothing is left to train (resuming would stop at once): the final validation is what is lost
    last = engines_lost_message("engine 0: dead", (0, 2), 11, CHECKPOINT, last_step=True)
    assert "so the run's final validation cannot run; the 11 trained steps are in checkpoint" in last
    assert "step 12" not in last and "trainer.resume" not in last and "megatron-cpo eval" in last
    partial = engines_lost_message(None, (1, 2), 0, None)
    assert partial.startswith("a rollout engine died during the weight sync (1 of 2 left hold a partial update) "
                              "(2 started; last failure: unknown), so step 1 cannot be generated; no step had been "
                              "trained, nothing was written.")
