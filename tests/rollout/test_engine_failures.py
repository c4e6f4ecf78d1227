"""Engine failures with real Ray actors (restarts off; restarts: tests/trainer/test_engine_health.py): a killed
engine's prompts and a distillation teacher's scoring requests move to the survivor exactly once, an engine that
hangs while scores are awaited is given up within the health bound, losing every engine raises a clear error naming
the prompts, and an engine that cannot start says why."""
import dataclasses
import json
import os
import signal
import time

import numpy as np
import pytest
import ray

from megatron_cpo.rollout import RolloutEnginesLostError, RolloutEngineStartError, RolloutManager, SamplingParams
from megatron_cpo.rollout.config import EngineHealthConfig
from megatron_cpo.rollout.processes import engine_processes
from megatron_cpo.rollout.scoring import ScoreRequest
from tests.conditions import wait_until
from tests.rollout.conftest import tiny_rollout_config


def samples_in_generation(engine) -> int:
    """How many requests the engine actor's vLLM engine holds unfinished now (asked inside the actor)."""
    return ray.get(engine.__ray_call__.remote(lambda actor: actor.engine.get_num_unfinished_requests()), timeout=60)


def score_requests(tag: str) -> list[ScoreRequest]:
    return [ScoreRequest(f"{tag}-{i}", [1, 20 + i, 21 + i], [list(range(40, 40 + 30 + i)), [5, 6]], 3)
            for i in range(6)]


def test_killed_engine_prompts_are_redispatched_once_and_losing_all_engines_is_a_clear_error(ray_cluster,
                                                                                            tiny_model_dir):
    config = tiny_rollout_config(tiny_model_dir, restart=False)
    health = EngineHealthConfig(check_interval_s=1, timeout_s=5, restart=False)
    config = dataclasses.replace(config, engines=dataclasses.replace(config.engines, engine_health=health))
    with RolloutManager(config) as manager:
        params = SamplingParams(n=2, temperature=1.0, max_tokens=48, seed=3)
        ids = [f"kill-{i}" for i in range(10)]
        for i, request_id in enumerate(ids):
            manager.submit(request_id, [1, 30 + i, 31 + i], params)
        on_killed_engine = {request.request_id for request in manager._requests() if request.engine_index == 0}
        assert len(on_killed_engine) == 5  # the other 5 are on engine 1
        wait_until(lambda: samples_in_generation(manager.engines[0]), 120, "engine 0 to start generating")
        for request in score_requests("killed"):  # a teacher's requests, half of them on engine 0
            manager.submit_score(request)
        assert sorted(index for _, index in manager._scoring.values()) == [0, 0, 0, 1, 1, 1]
        ray.kill(manager.engines[0])

        groups = list(manager.completed(timeout=300))
        returned = [g.request_id for g in groups]
        assert sorted(returned) == sorted(ids), "every prompt must come back exactly once"
        redispatched = [g for g in groups if g.request_id in on_killed_engine and g.engine_index == 1]
        print(f"{len(redispatched)} of {len(on_killed_engine)} prompts of the killed engine were re-dispatched")
        assert redispatched
        assert manager.health() == [False, True]
        scores = manager.collect_scores([r.request_id for r in score_requests("killed")], timeout=300)
        for request in score_requests("again"):  # the same requests, all on engine 1 now
            manager.submit_score(request)
        again = manager.collect_scores(timeout=300)
        assert len(scores) == len(again) == 6
        for i in range(6):
            for scored, expected in zip(scores[f"killed-{i}"].responses, again[f"again-{i}"].responses):
                np.testing.assert_allclose(scored.log_probs, expected.log_probs, rtol=0, atol=1e-5)
                np.testing.assert_allclose(scored.topk_log_probs, expected.topk_log_probs, rtol=0, atol=1e-5)

        manager.submit("orphan", [1, 2, 3], SamplingParams(max_tokens=400, temperature=1.0))
        manager.submit_score(score_requests("hung")[0])
        [core] = [p for p in engine_processes(manager.actors.pid_dir, f"{manager.engine_names[1]}.pid")
                  if "EngineCore" in p.name() + " ".join(p.cmdline())]
        os.kill(core.pid, signal.SIGSTOP)  # alive and silent: only the health check finds it
        stopped = time.monotonic()
        with pytest.raises(RolloutEnginesLostError, match=r"all 2 rollout engines are lost.*'orphan'"):
            manager.collect_scores(["hung-0"], timeout=300)
        found_s = time.monotonic() - stopped
        print(f"the stopped engine was given up {found_s:.1f} s after SIGSTOP while scores were awaited")
        assert found_s < health.check_interval_s + health.timeout_s + 30  # + a loaded machine's slack
        assert "did not answer a health check" in manager.last_engine_failure
        with pytest.raises(RolloutEnginesLostError, match=r"all 2 rollout engines are lost.*'orphan'"):
            list(manager.completed(timeout=300))


def test_engine_that_cannot_start_reports_the_cause(ray_cluster, tmp_path):
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "no-such-architecture"}))
    with pytest.raises(RolloutEngineStartError, match="engine 0 failed to start") as err:
        RolloutManager(tiny_rollout_config(broken, num_engines=1))
    print(err.value)
    assert "no-such-architecture" in str(err.value)


def test_a_teacher_engine_killed_while_scoring_is_restarted_and_scores_them(ray_cluster, tiny_model_dir):
    """A distillation teacher's only engine (`frozen_weights`: it loads its own weights) is killed with scoring
    requests in flight: `collect_scores` waits for its restarted replacement, which serves without a push, and
    every request is scored once (on SmolLM2, an OOM-killed teacher engine used to end the run here)."""
    config = dataclasses.replace(tiny_rollout_config(tiny_model_dir, num_engines=1), frozen_weights=True)
    with RolloutManager(config) as manager:
        for request in score_requests("before"):
            manager.submit_score(request)
        before = manager.collect_scores(timeout=300)
        for request in score_requests("killed"):
            manager.submit_score(request)
        ray.kill(manager.engines[0])
        after = manager.collect_scores(timeout=300)
        assert (manager.engine_restarts, manager.num_engines_alive()) == (1, 1)
        assert "restart1" in manager.engine_names[0]
    assert sorted(after) == [f"killed-{i}" for i in range(6)]
    for i in range(6):
        for scored, expected in zip(after[f"killed-{i}"].responses, before[f"before-{i}"].responses):
            np.testing.assert_allclose(scored.log_probs, expected.log_probs, rtol=0, atol=1e-5)
