"""The driver interface's contract: rank 0's `LeadDriver` and the other ranks' `FollowerDriver` implement every
method of `Driver` (trainer/driver/interface.py) with its parameters, so the step loop, the same on every rank, calls
the same methods on both (their broadcasts meet in the two-rank runs of test_e2e_parallel.py)."""
import inspect

import pytest

from megatron_cpo.trainer.driver.follower import FollowerDriver
from megatron_cpo.trainer.driver.interface import Driver
from megatron_cpo.trainer.driver.lead import LeadDriver


def parameters(function) -> list[tuple[str, inspect._ParameterKind]]:
    return [(p.name, p.kind) for p in inspect.signature(function).parameters.values()]


@pytest.mark.parametrize("implementation", [LeadDriver, FollowerDriver])
def test_each_driver_implements_every_method_of_the_interface(implementation):
    assert not implementation.__abstractmethods__
    assert {"collect", "make_batch", "observe_controls", "log_step", "close"} <= Driver.__abstractmethods__
    for name in Driver.__abstractmethods__:
        assert parameters(getattr(implementation, name)) == parameters(getattr(Driver, name)), name


def test_a_follower_holds_nothing_of_rank_0s():
    """What the loop asks of every rank without a collective: a follower has no engines, data position or run
    controls, and nothing of rank 0's to log or validate."""
    follower = FollowerDriver()
    assert follower.engines is None and follower.checkpointed() == (None, {})
    assert follower.engine_counts() == (0, 0) and follower.engine_failure() is None
    assert follower.validate() == {}
    with follower.generation_held():
        pass
