"""Every rollout manager satisfies `RolloutEngines`, the one interface the trainer types its engines against: each of
the protocol's methods exists with the protocol's parameters (the managers' behaviour is tested with real engines in
test_manager.py, test_server_mode.py and the trainer's end-to-end runs)."""
import inspect

import pytest

from megatron_cpo.rollout.colocate import ColocatedRolloutManager
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.manager import RolloutManager
from megatron_cpo.rollout.server_client import ServerRolloutManager

METHODS = [name for name, member in vars(RolloutEngines).items() if callable(member) and not name.startswith("_")]


@pytest.mark.parametrize("manager", [RolloutManager, ServerRolloutManager, ColocatedRolloutManager])
def test_managers_implement_the_protocol(manager):
    assert len(METHODS) >= 12
    for name in METHODS:
        expected = list(inspect.signature(getattr(RolloutEngines, name)).parameters)
        assert list(inspect.signature(getattr(manager, name)).parameters) == expected, (manager.__name__, name)
    constructors = [klass.__init__ for klass in manager.__mro__ if "__init__" in vars(klass) and klass is not object]
    source = "".join(inspect.getsource(init) for init in constructors)
    for attribute in RolloutEngines.__annotations__:  # a property, or set by the manager's constructor (or its base's)
        is_property = isinstance(inspect.getattr_static(manager, attribute, None), property)
        assert is_property or f"self.{attribute}" in source, (manager.__name__, attribute)
