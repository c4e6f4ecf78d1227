"""vLLM sleep mode between colocated phases: where it applies (rollout/sleep_mode.py), and on CPU, a real engine
asked to sleep and wake does nothing, says so once, and generates the same greedy tokens afterwards."""
import logging

import pytest

from megatron_cpo.rollout import SamplingParams, sleep_mode


@pytest.mark.parametrize("enabled, platform, sleeps", [(True, True, True), (False, True, False),
                                                       (True, False, False), (False, False, False)])
def test_an_engine_sleeps_only_when_started_for_it_on_a_platform_that_has_it(enabled, platform, sleeps):
    reason = sleep_mode.why_not_sleeping(enabled, platform)
    assert (reason is None) == sleeps
    if not platform:
        assert "no sleep mode on this platform" in reason
    elif not enabled:
        assert "free_cache_engine=false" in reason


def test_the_reason_is_logged_once_per_engine(caplog, monkeypatch):
    monkeypatch.setattr(sleep_mode, "_explained", set())
    with caplog.at_level(logging.INFO, logger="megatron_cpo.rollout.sleep_mode"):
        for _ in range(3):
            sleep_mode.explain_once(0, "no sleep here")
        sleep_mode.explain_once(1, "no sleep here")
    assert [r.getMessage() for r in caplog.records] == ["engine 0: no sleep here", "engine 1: no sleep here"]


def test_cpu_engine_sleep_and_wake_do_nothing_and_generation_is_unchanged(manager):
    import ray

    assert not sleep_mode.platform_supports_sleep()  # the CPU build of vLLM
    greedy = SamplingParams(n=1, temperature=0.0, max_tokens=8)
    manager.submit("before-sleep", [1, 41, 51, 61], greedy)
    (before,) = manager.finished(timeout=300)
    engines = manager.engines
    assert ray.get([engine.sleep.remote(1) for engine in engines]) == [False] * len(engines)
    assert ray.get([engine.wake_up.remote() for engine in engines]) == [False] * len(engines)
    manager.submit("after-wake", [1, 41, 51, 61], greedy)
    (after,) = manager.finished(timeout=300)
    assert after.samples[0].token_ids == before.samples[0].token_ids
    assert manager.health() == [True] * len(engines)
