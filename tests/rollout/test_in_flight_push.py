"""Weight pushes while groups are generating (asynchronous training, docs/async.md), on the session's two real
engines: each in-flight policy leaves greedy samples exactly as an uninterrupted run makes them and labels every
token with the weight version that sampled it (the server mode runs the same check in test_server_mode.py)."""
import pytest

from tests.rollout.servers import push_interrupts_greedy_groups_without_changing_them


@pytest.mark.parametrize("in_flight", ["partial", "keep", "finish"])
def test_push_with_groups_in_flight_leaves_greedy_samples_unchanged(manager, tiny_model_dir, in_flight):
    push_interrupts_greedy_groups_without_changing_them(manager, tiny_model_dir, in_flight)


def test_a_push_that_allows_nothing_in_flight_refuses_outstanding_requests(manager):
    from megatron_cpo.rollout import SamplingParams

    manager.submit("outstanding", [1, 2, 3], SamplingParams(max_tokens=400, seed=1))
    try:
        with pytest.raises(RuntimeError, match="1 rollout requests are outstanding"):
            manager.begin_weight_sync()
    finally:
        manager.cancel_all()
