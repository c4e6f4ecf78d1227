"""Engines that hang or die during a run (issue 49): found within the documented bound, their prompts re-sent and
trained once, restarted and taking the pushed weights (with the sync check) before they get requests; when nothing
can continue, the run checkpoints and exits with one line, leaving no process behind.

One real run, because engine starts are this suite's cost: `python -m megatron_cpo.trainer` with two engines,
multi-turn episodes (tests/envs/scripted.py `GradedRetry` on the quickstart's warm model, whose turns end) under
asynchronous training (k = 1), restarts on with a budget of two. Cue points come from the pausing grader
(tests/trainer/graders.py): the test acts during the rollout after step S, with requests in flight. The unit-level
rules (pings, stall timers, the restart budget) are tests/rollout/test_health.py.
"""
import os
import re
import signal
import time
from pathlib import Path

import pytest

from megatron_cpo.config import load_config
from megatron_cpo.trainer.assemble import run_training
from tests.trainer.test_async_resume import epoch_prompts, trained_prompts
from tests.trainer.test_run_recovery import EXAMPLE, TrainProcess, error_lines, latest, logged_steps, rows

pytestmark = pytest.mark.usefixtures("restore_environment")
WARM_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"  # what the `warm_engine` serves
CHECK_INTERVAL_S, TIMEOUT_S = 1, 10
HANG_BOUND_S = CHECK_INTERVAL_S + TIMEOUT_S + 0.5  # docs/launch.md, "Engines that hang or die"
SYNC_CHECKED = "rollout/sync_check_max_abs_diff"
RESTARTED, REJOINED = r"restarted as \S+ is up", "rejoined with weight version"


def count(pattern: str, text: str) -> int:
    return len(re.findall(pattern, text))


@pytest.mark.engine  # a trainer subprocess that starts two engines and restarts them
def test_hung_and_dead_engines_are_restarted_until_the_budget_is_spent_then_the_run_stops_with_one_line(
        small_run_overrides, warm_engine, tmp_path):
    """Two engines, restarts on (`max_restarts=2`), `sync_check.every_n_pushes=1000` (so a probe runs only at the
    push before training and where a restarted engine joins), 12 steps at k = 1. The pause after step S holds the
    rollout of step S + 1 or S + 2 (whichever the controller is at), and an engine is given up at its next request
    or health check at the latest (a push checks them all), so each failure is caused at one pause and let run; the
    restarted engine comes up during the pause two steps later and joins the next push (read from the log):
    1. after step 1 one engine's vLLM engine core is stopped with SIGSTOP (alive, silent): it is given up within
       check_interval_s + timeout_s plus the step time, logged once, its turns re-sent to the other, and restarted;
       the new engine joins the first push once it is up, which the sync check covers, and then serves;
    2. after step 5 the other engine's core is killed: the same;
    3. after step 9 both (restarted) cores are killed: the budget is spent, so the run checkpoints the steps it
       trained and exits with status 1 and one line naming both engines and the fix, no traceback, no process left.
    Every step is logged once (`rollout/engine_restarts` counts), no sample is more than one version stale, and
    resumed in-process (on the session's warm engine) the run ends at step 12 having trained the epoch's first 48
    prompts in order, each once."""
    run_dir, job_dir = tmp_path / "run", tmp_path / "job"
    health = "actor_rollout_ref.rollout.engine_health."
    run = [*small_run_overrides, f"actor_rollout_ref.model.path={WARM_MODEL}", "data.max_response_length=64",
           "actor_rollout_ref.rollout.multi_turn.enable=true",
           "actor_rollout_ref.rollout.multi_turn.default_agent=tests.envs.scripted:GradedRetry",
           "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=2",
           "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn=24", "async_training.max_staleness=1",
           "trainer.total_training_steps=12", "trainer.save_freq=-1", "trainer.val_before_train=false",
           "trainer.test_freq=-1", "trainer.log_completions=8"]
    job = TrainProcess.pausing(
        [*run, "actor_rollout_ref.rollout.ray_address=local", "actor_rollout_ref.rollout.num_engines=2",
         "actor_rollout_ref.rollout.sync_check.every_n_pushes=1000", f"{health}check_interval_s={CHECK_INTERVAL_S}",
         f"{health}timeout_s={TIMEOUT_S}", f"{health}max_restarts=2"], job_dir, run_dir, after_steps=(1, 3, 5, 7, 9),
        max_pause_s=600)
    stderr = job.stderr.read_text
    try:
        job.wait_for((job_dir / "paused_1").exists, "the pause after step 1", timeout=1200)  # two engines start
        hung, other = job.engine_workers()
        os.kill(hung.pid, signal.SIGSTOP)
        stopped = time.monotonic()
        job.resume_rollout(after_step=1)
        job.wait_for(lambda: "did not answer a health check" in stderr(), "the hung engine given up")
        found_s = time.monotonic() - stopped
        job.wait_until_paused(after_step=3)  # the push of step 3 at the latest gave it up
        job.wait_for(lambda: count(RESTARTED, stderr()) == 1, "the first restarted engine up", timeout=900)
        job.resume_rollout(after_step=3)

        job.wait_until_paused(after_step=5)  # the push of step 5 at the latest took the restarted engine
        assert count(REJOINED, stderr()) == 1, stderr()[-3000:]
        other.kill()
        job.resume_rollout(after_step=5)
        job.wait_until_paused(after_step=7)
        job.wait_for(lambda: count(RESTARTED, stderr()) == 2, "the second restarted engine up", timeout=900)
        job.resume_rollout(after_step=7)

        job.wait_until_paused(after_step=9)
        assert count(REJOINED, stderr()) == 2, stderr()[-3000:]
        for core in job.engine_workers():
            core.kill()
        job.resume_rollout(after_step=9)
        returncode = job.wait_exit()
        stray = job.still_running(grace_s=30)
    finally:
        job.kill_all()
    text = stderr()
    print(f"the stopped engine was given up {found_s:.1f} s after SIGSTOP (bound {HANG_BOUND_S} s + a step)")
    assert found_s < HANG_BOUND_S + 60, (found_s, text[-3000:])  # + the step's time on a loaded 2-core machine
    assert returncode == 1, text[-3000:]
    assert "Traceback" not in text and stray == [], (stray, text[-3000:])
    failed = re.findall(r"rollout engine (\d) \((\S+)\) failed: ([^;]*)", text)
    assert len({name for _, name, _ in failed}) == len(failed) == 4, failed  # each engine logged once
    assert {slot for slot, _, _ in failed[:2]} == {"0", "1"} and "did not answer a health check" in failed[0][2]
    assert ["restart" in name for _, name, _ in failed] == [False, False, True, True], failed
    [error] = error_lines(text)
    assert "no rollout engine is left" in error and "max_restarts=2" in error and "trainer.resume=auto" in error
    assert count(r"engine \d \(rollout-engine-\w+-\d-restart1\)", error) == 2, error  # both engines named

    # the rollout of step 10 or 11, or the push after step 10 or 11, found no engine (the rollout held at the pause
    # may have generated everything before the kill, so the next step trains on it): 12 steps, so that is never the last
    trained = logged_steps(run_dir)
    assert trained in (list(range(1, 10)), list(range(1, 11)), list(range(1, 12))), trained
    checkpoint = f"step_{trained[-1]:06d}"
    assert f"checkpoint {run_dir / 'checkpoints' / checkpoint}" in error and latest(run_dir) == checkpoint
    metrics = rows(run_dir)
    # the push after step S brings weight version S + 1 (the push before training brought version 1)
    joined = [int(version) - 1 for version in re.findall(REJOINED + r" (\d+)", text)]
    assert len(joined) == 2 and 2 <= joined[0] <= 5 and 6 <= joined[1] <= 9, joined
    assert [step for step in trained if SYNC_CHECKED in metrics[step]] == joined  # checked where they joined
    assert all(metrics[step]["rollout/engines_alive"] == 2 for step in (1, *joined)), metrics
    restarts = [metrics[step]["rollout/engine_restarts"] for step in trained]
    assert restarts[0] == 0 and restarts[joined[1] - 1] == 2 and restarts == sorted(restarts), restarts
    assert all(metrics[step]["async/staleness_max"] <= 1 for step in trained)

    run_training(load_config(EXAMPLE, [*run, "trainer.resume=auto"]), warm_engine)
    assert logged_steps(run_dir) == list(range(1, 13))
    assert [p for prompts in trained_prompts(run_dir) for p in prompts] == epoch_prompts(load_config(EXAMPLE, run))[:48]
