"""When an engine is given up and how many restarts a run may spend (rollout/health.py), on a clock the test sets:
no engine, no Ray. The managers' use of it on real engines: tests/trainer/test_engine_health.py."""
import pytest

from megatron_cpo.config import ConfigError, build_config
from megatron_cpo.rollout.config import EngineHealthConfig
from megatron_cpo.rollout.health import MAX_UNWATCHED_GAP_S, EngineWatch, RestartBudget


def watch_looking_every(watch: EngineWatch, start: float, end: float, step: float = 0.5) -> float:
    """Look at the engines every `step` seconds from `start` to `end`, as a manager's wait does."""
    now = start
    while now < end:
        now = min(now + step, end)
        watch.look(now)
    return now


def test_pings_are_due_every_interval_and_an_unanswered_one_is_overdue_after_the_timeout():
    watch = EngineWatch(EngineHealthConfig(check_interval_s=10, timeout_s=30), num_engines=2)
    assert watch.pings_due(0.0, [0, 1]) == [0, 1]
    for index in (0, 1):
        watch.ping_sent(index, 0.0)
    assert watch.pings_due(5.0, [0, 1]) == []  # one is out for each
    watch.ping_answered(0)
    assert watch.pings_due(5.0, [0, 1]) == []  # engine 0's last ping was 5 s ago
    assert watch.pings_due(10.0, [0, 1]) == [0]
    assert watch.unanswered(30.0) == [] and watch.unanswered(30.5) == [1]
    watch.restart_clocks()  # a weight push: the late answer of engine 1 says nothing
    assert watch.unanswered(100.0) == [] and watch.pings_due(100.0, [0, 1]) == [0, 1]
    watch.ping_sent(1, 100.0)
    watch.forget(1)  # given up: its ping no longer counts
    assert watch.unanswered(200.0) == []


def test_a_busy_engine_stalls_only_while_another_finishes_groups_and_only_in_watched_time():
    watch = EngineWatch(EngineHealthConfig(stall_timeout_s=60), num_engines=3)
    watch.look(0.0)
    watch.given_work(0)
    watch.given_work(1)
    now = watch_looking_every(watch, 0.0, 100.0)
    assert watch.stalled([0, 1], [0, 1, 2]) == []  # nobody finished anything: left to the ping
    watch.progressed(1)
    assert watch.stalled([0, 1], [0, 1, 2]) == [0]  # 100 s without a group while engine 1 finished one
    watch.progressed(0)
    now = watch_looking_every(watch, now, now + 59)
    watch.progressed(1)
    assert watch.stalled([0, 1], [0, 1, 2]) == []  # 59 s: within the limit
    watch.look(now + 3600)  # an hour without looking (the trainer's update) adds only the gap: 59 + 2 s
    assert MAX_UNWATCHED_GAP_S == 2.0 and watch.stalled([0, 1], [0, 1, 2]) == [0]
    watch.restart_clocks()  # a weight push starts every clock over
    assert watch.stalled([0, 1], [0, 1, 2]) == []
    assert watch.stalled([0], [0]) == []  # alone: never a stall


def test_the_stall_timer_is_off_at_zero():
    watch = EngineWatch(EngineHealthConfig(stall_timeout_s=0), num_engines=2)
    watch.look(0.0)
    watch.given_work(0)
    watch_looking_every(watch, 0.0, 10_000.0, step=1.0)
    watch.progressed(1)
    assert watch.stalled([0], [0, 1]) == []


def test_restart_budget_per_engine_and_per_run():
    budget = RestartBudget(EngineHealthConfig(max_restarts_per_engine=2, max_restarts=3), num_engines=2)
    assert budget.refusal(0) is None
    assert [budget.spend(0), budget.spend(0)] == [1, 2]
    assert "engine 0 was restarted 2 times already" in budget.refusal(0)
    assert "max_restarts_per_engine=2" in budget.refusal(0)
    assert budget.refusal(1) is None
    budget.spend(1)
    assert budget.total == 3 and "max_restarts=3" in budget.refusal(1)
    off = RestartBudget(EngineHealthConfig(restart=False), num_engines=1)
    assert off.refusal(0) == "restarts are off (actor_rollout_ref.rollout.engine_health.restart=false)"


def test_engine_health_settings_load_with_their_dotted_names_and_refuse_bad_values():
    config = build_config({}, ["actor_rollout_ref.rollout.engine_health.timeout_s=5",
                               "actor_rollout_ref.rollout.engine_health.restart=false"])
    health = config.actor_rollout_ref.rollout.engine_health
    assert (health.timeout_s, health.restart, health.check_interval_s) == (5.0, False, 10.0)
    for bad, message in (("check_interval_s=0", "check_interval_s=0.0 must be > 0"),
                         ("stall_timeout_s=-1", "stall_timeout_s=-1.0 must be >= 0"),
                         ("max_restarts=-1", "must be >= 0")):
        with pytest.raises(ConfigError, match=message):
            build_config({}, [f"actor_rollout_ref.rollout.engine_health.{bad}"])
