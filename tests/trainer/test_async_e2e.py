"""Asynchronous training end to end on the tiny model: real Megatron, the session's real vLLM engine (Ray mode; the
server mode's in-flight push is tested in tests/rollout/test_server_mode.py), the real grading pool. Runs at k = 1
(partial rollouts: aborted at a push, continued on the new weights) and k = 2 (in-flight weight updates: paused in
vLLM's scheduler, with filter-groups), each three steps with a validation in the middle of the run, while training
requests are in flight."""
import pytest

from megatron_cpo.trainer.assemble import run_training
from tests.trainer.test_e2e import read_metrics

pytestmark = pytest.mark.usefixtures("restore_environment")


@pytest.mark.parametrize("k, extra", [
    (1, ()),
    (2, ("async_training.in_flight_weight_updates=true", "algorithm.filter_groups.enable=true",
         "algorithm.filter_groups.max_num_gen_batches=8")),
])
def test_asynchronous_run_bounds_staleness_and_logs_its_metrics(make_config, rollout_manager, tmp_path, k, extra):
    run_dir = tmp_path / f"k{k}"
    run_training(make_config(f"async_training.max_staleness={k}", "trainer.total_training_steps=3",
                             "trainer.test_freq=2", "trainer.val_before_train=false",
                             f"trainer.default_local_dir={run_dir}", *extra), rollout_manager)
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2, 3]
    assert "val/acc" in metrics[2] and "val/acc" in metrics[3]  # validated with training requests in flight
    for row in metrics.values():
        assert row["filter/kept_prompts"] == 4
        assert row["actor/grad_norm"] > 0 or row["filter/mean_metric_std"] == 0  # uniform groups: no gradient
        assert 0 <= row["async/staleness_mean"] <= row["async/staleness_max"] <= k
        assert 0 <= row["async/partial_rollout_frac"] <= 1
        assert row["async/buffered_groups"] + row["async/in_flight"] > 0  # the next batches were under way
        assert 0 < row["rollout_corr/rollout_is_eff_sample_size"] <= 1  # auto: token-level IS against the engine
        assert "rollout_corr/masked_fraction" in row
    assert metrics[1]["async/staleness_max"] == 0 and "mismatch/staleness_0/k3_kl" in metrics[1]  # nothing older yet
    assert max(row["async/staleness_max"] for row in metrics.values()) >= 1
    assert max(row["actor/grad_norm"] for row in metrics.values()) > 0
    assert any(key.startswith("mismatch/staleness_1/") for row in metrics.values() for key in row)
    assert "timing/engine_idle_s" in metrics[2] and metrics[2]["timing/weight_sync_s"] > 0
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
