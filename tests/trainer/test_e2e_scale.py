"""A CPO run with the fused lm-head, token-budget micro-batches, padding-free packing and activation recompute on (real
Megatron, vLLM engine, grading pool).

The equality of these paths with the padded logits path is proven in test_scale_paths.py; this run checks that the
trainer wires them through every pass (actor, reference, hinted actor, update) and that a budget below the longest
row fails with the message that names both numbers.
"""
import json
import math

import pytest

from megatron_cpo.trainer.assemble import run_training

SCALE = ("actor_rollout_ref.model.use_fused_kernels=true", "actor_rollout_ref.actor.use_dynamic_bsz=true",
         "actor_rollout_ref.model.use_remove_padding=true",
         "actor_rollout_ref.model.enable_gradient_checkpointing=true",
         "actor_rollout_ref.actor.use_kl_loss=true", "algorithm.adv_estimator=cpo",
         "trainer.total_training_steps=2", "trainer.val_before_train=false")


pytestmark = pytest.mark.usefixtures("restore_environment")


def test_cpo_run_with_fused_kernels_token_budgets_packing_and_recompute(make_config, rollout_manager, tmp_path):
    run_dir = tmp_path / "scale"
    # character-level prompts of up to ~300 tokens + 12 response tokens: a few rows per micro-batch; mi3 scores every
    # wrong response under its hint (negonly_mi3 only those of all-wrong prompts, which a batch may not have)
    config = make_config(*SCALE, "algorithm.wrap_method=mi3", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=800",
                         "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=1200",
                         f"trainer.default_local_dir={run_dir}")
    run_training(config, rollout_manager)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [row for row in rows if "actor/grad_norm" in row]
    assert len(steps) == 2
    for row in steps:
        assert row["actor/grad_norm"] > 0 and math.isfinite(row["actor/pg_loss"])
        assert row["cpo/hinted_frac"] > 0 and "cpo/mi_std" in row  # the hinted pass ran


def test_a_budget_below_the_longest_row_names_both_numbers(make_config, rollout_manager, tmp_path):
    config = make_config(*SCALE, "actor_rollout_ref.actor.log_prob_max_token_len_per_gpu=8",
                         f"trainer.default_local_dir={tmp_path / 'small'}")
    message = r"a sequence of \d+ tokens .*log_prob_max_token_len_per_gpu=8; raise .* to at least \d+"
    with pytest.raises(ValueError, match=message):
        run_training(config, rollout_manager)
