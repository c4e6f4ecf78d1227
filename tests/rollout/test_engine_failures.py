"""Engine failures with real Ray actors (restarts off; restarts: tests/trainer/test_engine_health.py): a killed
engine's prompts move to the survivor exactly once, losing every engine raises a clear error naming the prompts,
and an engine that cannot start says why."""
import json

import pytest
import ray

from megatron_cpo.rollout import RolloutEnginesLostError, RolloutEngineStartError, RolloutManager, SamplingParams
from tests.conditions import wait_until
from tests.rollout.conftest import tiny_rollout_config


def samples_in_generation(engine) -> int:
    """How many requests the engine actor's vLLM engine holds unfinished now (asked inside the actor)."""
    return ray.get(engine.__ray_call__.remote(lambda actor: actor.engine.get_num_unfinished_requests()), timeout=60)


def test_killed_engine_prompts_are_redispatched_once_and_losing_all_engines_is_a_clear_error(ray_cluster,
                                                                                            tiny_model_dir):
    with RolloutManager(tiny_rollout_config(tiny_model_dir, restart=False)) as manager:
        params = SamplingParams(n=2, temperature=1.0, max_tokens=48, seed=3)
        ids = [f"kill-{i}" for i in range(10)]
        for i, request_id in enumerate(ids):
            manager.submit(request_id, [1, 30 + i, 31 + i], params)
        on_killed_engine = {request.request_id for request in manager._requests() if request.engine_index == 0}
        assert len(on_killed_engine) == 5  # the other 5 are on engine 1
        wait_until(lambda: samples_in_generation(manager.engines[0]), 120, "engine 0 to start generating")
        ray.kill(manager.engines[0])

        groups = list(manager.completed(timeout=300))
        returned = [g.request_id for g in groups]
        assert sorted(returned) == sorted(ids), "every prompt must come back exactly once"
        redispatched = [g for g in groups if g.request_id in on_killed_engine and g.engine_index == 1]
        print(f"{len(redispatched)} of {len(on_killed_engine)} prompts of the killed engine were re-dispatched")
        assert redispatched
        assert manager.health() == [False, True]

        manager.submit("orphan", [1, 2, 3], SamplingParams(max_tokens=400, temperature=1.0))
        ray.kill(manager.engines[1])
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
