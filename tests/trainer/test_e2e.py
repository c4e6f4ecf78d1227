"""Whole training runs on CPU with real Megatron, a real vLLM engine and the real grading pool.

The runs share the session's engine; each run pushes its own weights to it before the first rollout. The model has
tied embeddings and the GRPO run trains at a large learning rate, so an engine serving anything but the pushed
weights shows in every step's `mismatch/*` and sync check; a run whose engine misses one push stops at that push.
"""
import dataclasses
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from megatron_cpo.trainer.assemble import run_training
from tests.rollout.servers import assert_engine_in_sync

VARYING = ("timing/", "timing_s/", "weight_sync/", "rollout/sync_check")  # timing_s/: verl's timings; noise


pytestmark = pytest.mark.usefixtures("restore_environment")


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """Per step, the merged metrics of every line logged for it (a resumed run appends to the same file)."""
    merged: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        merged.setdefault(row.pop("step"), {}).update(row)
    return merged


def deterministic(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(VARYING)}


def send_sigterm_after_first_step(run_dir: Path) -> threading.Thread:
    """SIGTERM this process (as SLURM preemption would) once step 1 is logged."""
    def watch():
        path = run_dir / "metrics.jsonl"
        while not (path.is_file() and any(json.loads(line)["step"] == 1 for line in path.read_text().splitlines())):
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_grpo_run_logs_val_acc_and_resumes_after_sigterm_identically(make_config, rollout_manager, tmp_path):
    """4 steps straight vs 2 steps, SIGTERM, resume, 2 steps: identical metrics. The early-stop monitor (on, but set
    not to fire) is part of the resumed state: a fresh monitor would log another `early_stop/baseline` at step 3.
    Learning rate 3e-2 on the tied model, sampling at temperature 0.7: the engine's log-probs of its samples (the
    tempered ones) must still equal the trainer's on every step."""
    straight_dir, preempted_dir = tmp_path / "straight", tmp_path / "preempted"
    overrides = ("trainer.total_training_steps=4", "trainer.val_before_train=true", "trainer.early_stop.enable=true",
                 "trainer.early_stop.baseline_steps=2", "trainer.early_stop.window=2", "trainer.early_stop.ratio=1e-6",
                 "actor_rollout_ref.actor.optim.lr=3e-2", "actor_rollout_ref.rollout.temperature=0.7")
    run_training(make_config(*overrides, f"trainer.default_local_dir={straight_dir}"), rollout_manager)
    straight = read_metrics(straight_dir)
    assert "val/acc" in straight[0] and "val/acc" in straight[4]
    assert straight[0]["rollout/sync_check_max_abs_diff"] < 1e-4  # the push before training
    assert_engine_in_sync(straight, range(1, 5))
    assert straight[1]["filter/kept_prompts"] == 4 and straight[4]["actor/grad_norm"] > 0
    assert straight[1]["early_stop/baseline"] == 0 and straight[3]["early_stop/baseline"] == pytest.approx(
        (straight[1]["rollout/in_group_reward_std"] + straight[2]["rollout/in_group_reward_std"]) / 2)
    assert straight[4]["train/early_stopped"] == 0

    preempted = make_config(*overrides, f"trainer.default_local_dir={preempted_dir}", "trainer.resume=auto")
    watcher = send_sigterm_after_first_step(preempted_dir)
    run_training(preempted, rollout_manager)
    watcher.join(timeout=5)
    stopped_at = max(step for step in read_metrics(preempted_dir) if step > 0)
    # SIGTERM arrives during step 2 (it is sent once step 1 is logged): the run finishes that step, checkpoints and
    # stops; 3 only if step 2 took less than the watcher's 0.2 s poll
    assert stopped_at in (2, 3), "the run should have stopped early on SIGTERM"
    assert (preempted_dir / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:06d}"
    run_training(preempted, rollout_manager)
    resumed = read_metrics(preempted_dir)
    for step in (1, 2, 3, 4):
        expected, got = deterministic(straight[step]), deterministic(resumed[step])
        assert expected.keys() == got.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), (step, key)


class SkipsOnePush:
    """The session's manager (its real engine) leaving the engine stale once: weight push number `skip` (0: the one
    before training) goes to no engine, as a transport or reload that silently fails would."""

    def __init__(self, manager, skip: int) -> None:
        self.manager, self.skip, self.pushes, self.skipping = manager, skip, 0, False

    def __getattr__(self, name):
        return getattr(self.manager, name)

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        self.skipping, self.pushes = self.pushes == self.skip, self.pushes + 1
        if not self.skipping:
            self.manager.begin_weight_sync(in_flight)

    def sender_spec(self, transport=None):
        spec = self.manager.sender_spec(transport)
        return dataclasses.replace(spec, engine_names=()) if self.skipping else spec

    def finish_weight_sync(self, resume: bool = True) -> dict:
        return {} if self.skipping else self.manager.finish_weight_sync(resume)


def test_a_run_whose_engine_misses_a_push_stops_there_naming_it(make_config, rollout_manager, tmp_path):
    from megatron_cpo.trainer.run.errors import RunAbortedError

    run_dir = tmp_path / "stale"
    config = make_config("trainer.total_training_steps=3", "trainer.val_before_train=false",
                         "actor_rollout_ref.actor.optim.lr=3e-2", f"trainer.default_local_dir={run_dir}")
    with pytest.raises(RunAbortedError) as err:
        run_training(config, SkipsOnePush(rollout_manager, skip=1))
    message = str(err.value)
    print(message)
    assert "\n" not in message
    assert message.startswith("the engines do not serve the trainer's weights after the weight push of step 1: the "
                              "largest |engine - trainer| log-prob difference on the sync probe is ")
    assert "above the tolerance 0.001 for float32" in message and "checkpoints/step_000001" in message
    metrics = read_metrics(run_dir)
    assert max(metrics) == 1 and metrics[1]["actor/grad_norm"] > 0  # the weights did change, the engine did not
    assert metrics[1]["rollout/sync_check_max_abs_diff"] > 1e-3
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"


def test_cpo_with_dynamic_sampling_ragen_overlong_entropy_mask_and_early_stop(make_config, rollout_manager, tmp_path):
    """One CPO step with every selection and loss feature on, then the reward-variance early stop ends the run.
    The rule is `mi3`, whose hint terms act on every wrong response (negonly_mi3's act on all-wrong prompts only,
    which filter-groups does not keep): only the wrong responses are scored under their hints."""
    run_dir = tmp_path / "cpo"
    config = make_config(
        "algorithm.adv_estimator=cpo", "algorithm.wrap_method=mi3",
        "algorithm.filter_groups.enable=true", "algorithm.filter_groups.max_num_gen_batches=8",
        "actor_rollout_ref.rollout.rollout_filter_strategy=top_k", "actor_rollout_ref.rollout.rollout_filter_value=3",
        "actor_rollout_ref.actor.filter_loss_scaling=linear", "actor_rollout_ref.actor.top_entropy_quantile=0.5",
        "reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=6",
        "reward_model.overlong_buffer.log=true",
        # ratio 2: "low" is below twice the baseline, so the first value after the 1-step baseline stops the run
        "trainer.early_stop.enable=true", "trainer.early_stop.baseline_steps=1", "trainer.early_stop.window=1",
        "trainer.early_stop.ratio=2.0",
        "trainer.total_training_steps=3", "trainer.val_before_train=false",
        "actor_rollout_ref.actor.use_kl_loss=true", f"trainer.default_local_dir={run_dir}")
    run_training(config, rollout_manager)
    metrics = read_metrics(run_dir)
    step = metrics[1]
    assert step["cpo/hints_truncated"] == 0
    # filter-groups kept 4 mixed prompts of 2 responses: their 4 wrong ones were scored under the hint (data.hint_key)
    assert step["cpo/hint_source/extra_info.solution"] == 4 and step["cpo/hinted_frac"] == 0.5
    assert step["cpo/hint_bare_answer"] == 0
    assert step["cpo/shaped_token_frac"] > 0 and step["cpo/kl_mean"] != 0 and "cpo/mi_wrong_p50" in step
    assert "cpo/mi_correct_p50" not in step  # no correct response was scored under a hint
    assert step["cpo/difficulty_mixed"] == 1.0  # filter-groups kept only mixed prompts
    assert step["filter/kept_prompts"] == 4 and "kl" in step
    # RAGEN keeps at most 3 of every 4 groups, and the loss scale is that kept ratio (filter_loss_scaling=linear)
    assert 0 < step["filter/kept_ratio"] <= 0.75
    assert step["filter/loss_scale"] == pytest.approx(step["filter/kept_ratio"])
    # the overlong buffer covers lengths 7..12 of the 12-token budget; the untrained model often runs that long
    assert step["overlong/frac"] > 0 and step["overlong/reward_mean"] < 0
    assert "entropy/threshold" in step  # the entropy mask chose this micro-batch's top-50% entropy tokens
    assert step["train/early_stopped"] == 1.0 and step["early_stop/baseline"] > 0
    assert max(metrics) == 1 and "val/acc" in metrics[1], "the run ends after step 1 with a final validation"
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"

    run_training(config, rollout_manager)  # resuming a stopped run trains nothing
    assert max(read_metrics(run_dir)) == 1


def test_sample_budget_ends_the_run_and_validates_by_samples(make_config, rollout_manager, tmp_path):
    """`trainer.total_rollout_samples` ends the run after the step whose generated samples reach it (checkpointed,
    validated), `trainer.test_freq_samples` validates after each step that crosses a multiple, and
    `trainer.max_actor_ckpt_to_keep` keeps the newest checkpoint only. A GRPO step here generates 4 x 2 = 8 samples:
    a budget of 20 ends the run after step 3 (24 samples) and validation falls after steps 2 (16 > 12) and 3."""
    run_dir = tmp_path / "budget"
    config = make_config("trainer.total_training_steps=10", "trainer.total_rollout_samples=20",
                         "trainer.test_freq_samples=12", "trainer.val_before_train=false", "trainer.save_freq=1",
                         "trainer.max_actor_ckpt_to_keep=1", f"trainer.default_local_dir={run_dir}")
    run_training(config, rollout_manager)
    metrics = read_metrics(run_dir)
    assert max(metrics) == 3 and [metrics[s]["train/generated_samples"] for s in (1, 2, 3)] == [8.0, 16.0, 24.0]
    assert all(metrics[s]["rollout/generated_samples"] == 8.0 for s in (1, 2, 3))
    assert ["val/acc" in metrics[s] for s in (1, 2, 3)] == [False, True, True]
    checkpoints = run_dir / "checkpoints"
    assert sorted(p.name for p in checkpoints.glob("step_*")) == ["step_000003"]
    assert (checkpoints / "latest").read_text().strip() == "step_000003"

    run_training(config, rollout_manager)  # resumed: the budget is spent, nothing more is trained
    assert max(read_metrics(run_dir)) == 3
