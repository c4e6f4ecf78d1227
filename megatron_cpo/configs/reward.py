"""verl's top-level `custom_reward_function`. The `reward.*` section is `rewards.manager.RewardConfig` (the reward
manager's own config, embedding the sandbox's, the remote reward model's and DAPO's overlong buffer's); it is
re-exported here."""
from __future__ import annotations

from dataclasses import dataclass

from megatron_cpo.algorithms.overlong import OverlongBufferConfig  # noqa: F401  (re-exported)
from megatron_cpo.configs.checks import check
from megatron_cpo.rewards.manager import RewardConfig  # noqa: F401  (re-exported)
from megatron_cpo.rewards.remote import RemoteRewardConfig  # noqa: F401  (re-exported)
from megatron_cpo.rewards.sandbox import SandboxConfig  # noqa: F401  (re-exported)


@dataclass
class CustomRewardFunctionConfig:
    """verl's `custom_reward_function`: the Python file `path` and the function `name` in it that grades every
    response, called as `name(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` and returning
    a score or a dict with `score` (and `acc`)."""
    path: str = ""
    name: str = "compute_score"

    def __post_init__(self) -> None:
        check(not self.path or bool(self.name), "custom_reward_function.name is empty; name the function in "
                                                 f"{self.path!r} that computes the score (verl: compute_score)")

    @property
    def spec(self) -> str:
        """"file.py:function", the form `megatron_cpo.rewards.load_callable` imports; "" when unset."""
        return f"{self.path}:{self.name}" if self.path else ""
