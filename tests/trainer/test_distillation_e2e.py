"""On-policy distillation trained end to end on CPU (real Megatron, the session's vLLM engine, the grading pool):
two or three steps of each teacher kind and signal form on the tiny model (the self teacher with top-k too).

The engine teacher is the session's engine itself, which serves the student's pushed weights: at temperature 1 the
teacher then agrees with the student up to float noise, so a signal near 0 says that the teacher's log-probs (and
top-k ids) are aligned with the student's tokens; a misaligned position would show as a divergence of several nats.
A teacher log-prob that is not finite ends the run with the teacher's error, the steps before it checkpointed.
"""
import json
import math

import pytest
import torch

from megatron_cpo.rollout.engine_teacher import EngineTeacher
from megatron_cpo.trainer.assemble import run_training
from megatron_cpo.trainer.run.errors import RunAbortedError
from tests.trainer.test_e2e import read_metrics

pytestmark = pytest.mark.usefixtures("restore_environment")
NOISE = 1e-3  # |student - teacher| log-prob of float32 engines against the trainer, same weights


class FailingTeacher(EngineTeacher):
    """The session's engine as a teacher that fails at its `failing_batch`-th step batch: its first group's first
    log-prob is NaN (`nan`, caught by the teacher's own check), or its collect raises (`raise`)."""

    def __init__(self, engines, failing_batch: int, failure: str) -> None:
        super().__init__("teacher_model", engines, 0, owns_engines=False)
        self.failing_batch, self.failure, self.batches = failing_batch, failure, 0

    def collect(self, request_ids, timeout=None):
        self.batches += 1
        if self.batches == self.failing_batch and self.failure == "raise":
            raise ConnectionError("the teacher's server closed the connection")
        return super().collect(request_ids, timeout)

    def _scores(self, request_id, group):
        if self.batches == self.failing_batch and self.failure == "nan":
            group.responses[0].log_probs[0] = float("nan")
        return super()._scores(request_id, group)


def _teacher(make_config, tiny_model, run_dir, *overrides):
    return make_config("distillation.enabled=true", "distillation.nnodes=0",
                       f"distillation.teacher_models.teacher_model.model_path={tiny_model}",
                       f"trainer.default_local_dir={run_dir}", *overrides)


def _finite_distillation(row: dict) -> None:
    assert math.isfinite(row["actor/distillation/loss"]), row
    assert row["actor/distillation/loss_min"] <= row["actor/distillation/loss_max"]
    assert row["actor/update_skipped"] == 0 and row["actor/grad_norm"] > 0


def test_k1_as_a_reward_from_an_engine_teacher_and_a_nan_teacher_refused(make_config, rollout_manager, tiny_model,
                                                                         tmp_path):
    """verl's 0.6b OPD script's signal (k1, policy gradient, no task reward, rollout.n=1): the teacher's log-probs
    of the sampled tokens, scored as each group finished; step 3's teacher answers a NaN: the run ends naming it,
    with steps 1-2 checkpointed."""
    config = _teacher(make_config, tiny_model, tmp_path / "run", "trainer.total_training_steps=3",
                      "actor_rollout_ref.rollout.n=1", "distillation.distillation_loss.loss_mode=k1",
                      "distillation.distillation_loss.use_policy_gradient=true",
                      "distillation.distillation_loss.use_task_rewards=false", "trainer.save_freq=1")
    teacher = FailingTeacher(rollout_manager, failing_batch=3, failure="nan")
    with pytest.raises(RunAbortedError, match="step 3 stopped before its update: teacher 'teacher_model' gave a "
                                              "non-finite log-prob \\(nan\\) to token 0 of response "
                                              "'step\\d+-e\\d+-o\\d+/sample0'.*checkpointed in"):
        run_training(config, rollout_manager, teachers={"teacher_model": teacher})
    metrics = read_metrics(tmp_path / "run")
    assert sorted(step for step in metrics if step > 0) == [1, 2]
    for row in (metrics[1], metrics[2]):
        _finite_distillation(row)
        assert row["distillation/teacher_seconds"] > 0 and "actor/distillation/pg_clipfrac" in row
        assert row["actor/distillation/abs_loss"] < NOISE  # the teacher is the student's own engine
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000002"


def test_a_teacher_that_raises_ends_the_run_named(make_config, rollout_manager, tiny_model, tmp_path):
    """A teacher whose scoring fails (here at step 2) ends the run before that update with the teacher's name and
    error; step 1 is checkpointed."""
    config = _teacher(make_config, tiny_model, tmp_path / "run", "trainer.total_training_steps=2",
                      "distillation.distillation_loss.loss_mode=k3")
    teacher = FailingTeacher(rollout_manager, failing_batch=2, failure="raise")
    with pytest.raises(RunAbortedError, match="step 2 stopped before its update: teacher 'teacher_model' failed to "
                                              "score \\d+ group\\(s\\) \\(ConnectionError: the teacher's server closed"
                                              ".*checkpointed in"):
        run_training(config, rollout_manager, teachers={"teacher_model": teacher})
    assert (tmp_path / "run" / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_top_k_forward_kl_from_an_engine_teacher_on_the_fused_lm_head(make_config, rollout_manager, tiny_model,
                                                                     tmp_path):
    """verl's 8B OPD script's signal (forward_kl_topk as a loss, clamps on, no task reward): the student's log-probs
    at the teacher's top-k ids from the fused lm-head; teacher = student, so the top-k KL is ~0 and both top-k masses
    agree."""
    config = _teacher(make_config, tiny_model, tmp_path / "run", "trainer.total_training_steps=2",
                      "distillation.distillation_loss.loss_mode=forward_kl_topk",
                      "distillation.distillation_loss.topk=4",
                      "distillation.distillation_loss.use_task_rewards=false",
                      "distillation.distillation_loss.loss_max_clamp=10.0",
                      "distillation.distillation_loss.log_prob_min_clamp=-10.0",
                      "actor_rollout_ref.model.use_fused_kernels=true")
    run_training(config, rollout_manager,
                 teachers={"teacher_model": EngineTeacher("teacher_model", rollout_manager, 4, owns_engines=False)})
    metrics = read_metrics(tmp_path / "run")
    for row in (metrics[1], metrics[2]):
        _finite_distillation(row)
        assert 0 <= row["actor/distillation/loss_max"] < NOISE
        assert row["actor/distillation/student_mass"] == pytest.approx(row["actor/distillation/teacher_mass"],
                                                                       abs=NOISE)
        # the random tiny model's near-ties within float noise may swap ids between the two top-k sets
        assert 0 < row["actor/distillation/overlap_ratio"] <= 1


def test_self_teacher_top_k_forward_kl_with_the_task_reward_resumes(make_config, rollout_manager, tmp_path):
    """On-policy self-distillation: the policy given the gold solution (the hint context) as its own teacher, top-k
    forward KL (the teacher's top-k from the trainer's hinted pass) as a loss added to GRPO's; the hint changes the
    distribution, so the signal is not 0 and the two top-k sets differ somewhere. Resumed for a third step, the run
    logs every step once. (k3 as a loss: test_a_teacher_that_raises_ends_the_run_named.)"""
    overrides = ("distillation.enabled=true", "distillation.teacher_models.teacher_model.kind=self",
                 "distillation.nnodes=0", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                 "distillation.distillation_loss.topk=4", "distillation.distillation_loss.use_task_rewards=true",
                 "distillation.distillation_loss.distillation_loss_coef=0.5", "trainer.resume=auto",
                 f"trainer.default_local_dir={tmp_path / 'run'}")
    run_training(make_config(*overrides, "trainer.total_training_steps=2"), rollout_manager)
    run_training(make_config(*overrides, "trainer.total_training_steps=3"), rollout_manager)
    metrics = read_metrics(tmp_path / "run")
    for row in (metrics[1], metrics[2], metrics[3]):
        _finite_distillation(row)
        # measured: loss_max 6.8e-3, 3.7e-3, 8.9e-4 at steps 1-3 (the top-4 hold ~6% of the tiny model's mass, and
        # the loss pulls the two together), overlap 0.82-0.93; without the hint the teacher's pass would be the
        # student's own: 0 and 1 (the bounds leave room for another CPU's dtype and samples)
        assert row["actor/distillation/loss_max"] > 1e-5 and "actor/pg_loss" in row
        assert 0 < row["actor/distillation/overlap_ratio"] < 0.99
        assert row["timing/teacher_log_prob_s"] > 0 and "distillation/teacher_seconds" not in row
        assert 0 < row["actor/distillation/teacher_mass"] <= 1 + NOISE
        assert 0 < row["actor/distillation/student_mass"] <= 1 + NOISE
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    logged = [json.loads(line)["step"] for line in lines if "actor/distillation/loss" in json.loads(line)]
    assert logged == [1, 2, 3]


def test_slimes_additive_form_from_a_frozen_megatron_teacher(make_config, rollout_manager, tiny_model, tmp_path):
    """slime's form (opd_kl_coef, k1) with a frozen Megatron teacher of the student's initial weights: at step 1 the
    student is the teacher, so the reverse KL is ~0; after an update at a large learning rate it is not."""
    config = _teacher(make_config, tiny_model, tmp_path / "run", "trainer.total_training_steps=2",
                      "distillation.teacher_models.teacher_model.kind=megatron", "distillation.opd_kl_coef=0.5",
                      "distillation.distillation_loss.loss_mode=k1", "actor_rollout_ref.actor.optim.lr=3e-2")
    run_training(config, rollout_manager)
    metrics = read_metrics(tmp_path / "run")
    assert abs(metrics[1]["distillation/opd_reverse_kl"]) < NOISE
    assert abs(metrics[2]["distillation/opd_reverse_kl"]) > 10 * NOISE
    assert "actor/distillation/loss" not in metrics[1]  # no loss term: the advantages carry the signal


def test_teacher_signal_positions_round_trip():
    """`at_positions` places response-aligned values where `to_response` reads them (right-padded and packed rows)."""
    from megatron_cpo.trainer.batch.packing import pack_rows
    from megatron_cpo.trainer.batch.sequences import pack_sequences
    from megatron_cpo.trainer.workers.distillation_step import at_positions

    seqs = pack_sequences([[1, 2, 3], [4], [5, 6]], [[7, 8], [9, 10, 11], []], 0, 4)
    values = torch.arange(3 * 4 * 2).reshape(3, 4, 2) + 1
    for layout in (seqs, pack_rows(seqs, "rows"), pack_rows(seqs, "thd")):
        placed = at_positions(layout, values, -100)
        back = torch.stack([layout.to_response(placed[..., i]) for i in range(2)], -1)
        valid = seqs.response_mask().bool()
        assert torch.equal(back[valid], values[valid]) and int((placed != -100).sum()) == 2 * int(valid.sum())
