"""The `reward.*` section (`RewardConfig`) and its remote reward model (`reward.remote`, `RemoteRewardConfig`):
torch-free and grader-free, so that loading a config imports neither torch nor the graders. `RewardManager`
(manager.py) reads the section; which data sources it can grade is the registry's (`registry.sources_without_grader`).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.config import OverlongBufferConfig
from megatron_cpo.config_checks import ConfigError, check_choice
from megatron_cpo.rewards.sandbox_types import SandboxConfig

COMBINE_MODES = ("replace", "add")
ON_ERROR_MODES = ("raise", "failure_score")
NON_FINITE_POLICIES = ("error", "zero")  # what a NaN or infinite score does (rewards/non_finite.py)


@dataclass
class RemoteRewardConfig:
    """A reward model served over HTTP (`reward.remote`), scoring every graded response: `url` (+ `/score`), `combine`
    (`replace` or `add` to the rule score), batching, timeout and retry schedule, and `on_error` (`raise`, or
    `failure_score` and train on). docs/data.md, "A remote reward model".
    """

    enable: bool = False
    url: str = ""
    combine: str = "replace"
    batch_size: int = 64
    timeout_s: float = 30.0
    max_retries: int = 3
    backoff_s: float = 0.5
    backoff_multiplier: float = 2.0
    max_concurrent: int = 4
    on_error: str = "raise"
    failure_score: float = 0.0

    def __post_init__(self) -> None:
        if self.enable and not self.url.startswith(("http://", "https://")):
            raise ConfigError(f"reward.remote.url={self.url!r} must start with http:// or https://, e.g. "
                              "http://127.0.0.1:8000 (or set reward.remote.enable=false)")
        for name, value, choices in (("combine", self.combine, COMBINE_MODES),
                                     ("on_error", self.on_error, ON_ERROR_MODES)):
            if value not in choices:
                raise ConfigError(f"reward.remote.{name}={value!r} is not supported; choose one of {choices}")
        if self.batch_size < 1 or self.max_concurrent < 1:
            raise ConfigError(f"reward.remote.batch_size={self.batch_size} and reward.remote.max_concurrent="
                              f"{self.max_concurrent} must be >= 1")
        if self.timeout_s <= 0 or self.max_retries < 0 or self.backoff_s < 0 or self.backoff_multiplier < 1:
            raise ConfigError(f"reward.remote.timeout_s={self.timeout_s} must be > 0, max_retries="
                              f"{self.max_retries} and backoff_s={self.backoff_s} >= 0, backoff_multiplier="
                              f"{self.backoff_multiplier} >= 1")


@dataclass
class RewardConfig:
    """`reward.*`: the grading pool (`num_workers`, `timeout_s` per sample, `worker_memory_limit_mb`), what grades each
    response (`custom_reward_function`, `custom_graders`, `grader_kwargs`, `custom_failure_score`), the code `sandbox`,
    a `remote` reward model, `non_finite` and DAPO's overlong buffer (applied by the trainer's group selection). Every
    setting: docs/data.md, "Reward settings"; the sandbox: docs/sandbox.md.
    """

    num_workers: int = 2
    timeout_s: float = 10.0
    custom_reward_function: str = ""
    custom_reward_function_name: str = "compute_score"
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    custom_graders: dict[str, str] = field(default_factory=dict)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)
    custom_failure_score: float = 0.0
    grader_kwargs: dict[str, dict] = field(default_factory=dict)
    worker_memory_limit_mb: int = 4096
    non_finite: str = "error"

    def __post_init__(self) -> None:
        check_choice("reward.non_finite", self.non_finite, NON_FINITE_POLICIES)
        if self.num_workers < 1:
            raise ValueError(f"reward.num_workers={self.num_workers} must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError(f"reward.timeout_s={self.timeout_s} must be > 0 (seconds; code graders need their "
                             "total_timeout_s plus process start-up)")
        if self.worker_memory_limit_mb and self.worker_memory_limit_mb < 512:
            raise ValueError(f"reward.worker_memory_limit_mb={self.worker_memory_limit_mb} cannot hold sympy and the "
                             "graders; use >= 512, or 0 for no limit")
        function, name = self.custom_reward_function, self.custom_reward_function_name
        if function and not function.endswith(".py") and name != "compute_score":
            raise ValueError(f"reward.custom_reward_function={function!r} names its function, but "
                             f"reward.custom_reward_function_name (verl: custom_reward_function.name)={name!r} names "
                             "another; give the .py file alone (verl: custom_reward_function.path) or drop the name")
        if function.endswith(".py") and not name:
            raise ValueError(f"custom_reward_function.name is empty; name the function in {function!r} that computes "
                             "the score (verl: compute_score)")
        for source, path in self.custom_graders.items():
            if not (isinstance(path, str) and ":" in path):
                raise ValueError(f"reward.custom_graders[{source!r}]={path!r} must be 'pkg.module:function' or "
                                 "'file.py:function'")
        for source, kwargs in self.grader_kwargs.items():
            if not isinstance(kwargs, dict):
                raise ValueError(f"reward.grader_kwargs[{source!r}]={kwargs!r} must be a mapping of the grader's "
                                 "keyword arguments, e.g. {wrong_score: 0.0}")

    @property
    def reward_function(self) -> str:
        """The function that grades every response ("pkg.module:fn" or "file.py:fn"), "" when the grader of each
        response's data source grades it."""
        if self.custom_reward_function.endswith(".py"):
            return f"{self.custom_reward_function}:{self.custom_reward_function_name}"
        return self.custom_reward_function

    @property
    def needs_ground_truth(self) -> bool:
        """Whether every data row needs a `reward_model.ground_truth`: the grader of its data source compares each
        response with it; one `reward_function` for every response may not read it (verl's reward-model data)."""
        return not self.reward_function
