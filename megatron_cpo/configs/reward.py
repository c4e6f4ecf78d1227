"""`reward.*` (graders, the code sandbox, a remote reward model, DAPO's overlong buffer) and verl's top-level
`custom_reward_function`."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.configs.checks import check, check_choice
from megatron_cpo.rewards.remote import RemoteRewardConfig


@dataclass
class OverlongBufferConfig:
    """DAPO's soft overlong punishment (verl's `reward_model.overlong_buffer`, accepted as an alias): a response
    longer than `data.max_response_length - len` tokens gets `-(length - (max - len)) / len * penalty_factor` added
    to its score, before the group filters and the advantages see it (`acc` is unchanged). `log: true` logs
    `overlong/reward_mean` (mean penalty) and `overlong/frac` (share of penalised responses) per step."""
    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0
    log: bool = False

    def __post_init__(self) -> None:
        check(self.penalty_factor >= 0, f"reward.overlong_buffer.penalty_factor={self.penalty_factor} must be >= 0")
        check(not self.enable or self.len > 0, f"reward.overlong_buffer.len={self.len} must be > 0 when the buffer "
                                                "is enabled (tokens before data.max_response_length where the "
                                                "penalty ramps up; DAPO uses max_response_length / 5)")


@dataclass
class SandboxConfig:
    """Where model-written code runs (see `megatron_cpo/rewards/sandbox.py`). `namespaces`: an unprivileged uid in
    its own PID/mount/IPC/UTS/network namespaces with rlimits (the isolation boundary; needs root or CAP_SYS_ADMIN);
    `remote`: a SandboxFusion service (`reward.sandbox_fusion.url`); `process`: rlimits and a throwaway uid only,
    NOT a boundary (logs a warning and `reward/sandbox_weak=1`); `auto`: remote when a URL is set, else namespaces
    when this machine allows them, else process; the choice is logged."""
    mode: str = "auto"

    def __post_init__(self) -> None:
        check_choice("reward.sandbox.mode", self.mode, ("auto", "namespaces", "process", "remote"))


@dataclass
class SandboxFusionConfig:
    """verl's `reward_model.sandbox_fusion` (accepted as an alias): `url` of the `run_code` endpoint (e.g.
    `http://host:8080/run_code`), `max_concurrent` requests per grading worker (the test cases of one sample run in
    parallel), `memory_limit_mb` per program."""
    url: str = ""
    max_concurrent: int = 64
    memory_limit_mb: int = 1024

    def __post_init__(self) -> None:
        check(self.max_concurrent >= 1, f"reward.sandbox_fusion.max_concurrent={self.max_concurrent} must be >= 1")
        check(self.memory_limit_mb >= 64, f"reward.sandbox_fusion.memory_limit_mb={self.memory_limit_mb} must be "
                                           ">= 64 (a Python interpreter needs about that)")


@dataclass
class RewardConfig:
    """The reward process pool: how many workers score responses and how long one grading may take.

    `custom_reward_function` ("pkg.module:function" or "file.py:function") grades every response instead of the
    grader registered for its data source; it takes `data_source, solution_str, ground_truth, extra_info` keywords
    and returns a score or a dict with `score` and `acc`. verl's spelling, `custom_reward_function.path` +
    `custom_reward_function.name` at the top level, is accepted too (one or the other).
    `custom_graders` (`{data_source: "pkg.module:fn"}`) adds or replaces the grader of single sources, in the
    trainer (data check) and in every grading worker.
    `remote` (`reward.remote.*`): a reward model served over HTTP whose score replaces or is added to the rule score.
    """
    num_workers: int = 2
    timeout_s: float = 10.0
    custom_reward_function: str = ""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    custom_graders: dict[str, str] = field(default_factory=dict)
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    sandbox_fusion: SandboxFusionConfig = field(default_factory=SandboxFusionConfig)
    remote: RemoteRewardConfig = field(default_factory=RemoteRewardConfig)

    def __post_init__(self) -> None:
        check(self.num_workers >= 1, f"reward.num_workers={self.num_workers} must be >= 1")
        check(self.timeout_s > 0, f"reward.timeout_s={self.timeout_s} must be > 0")
        for source, path in self.custom_graders.items():
            check(isinstance(path, str) and ":" in path, f"reward.custom_graders[{source!r}]={path!r} must be "
                   "'pkg.module:function' or 'file.py:function'")
        check(self.sandbox.mode != "remote" or bool(self.sandbox_fusion.url),
               "reward.sandbox.mode=remote needs reward.sandbox_fusion.url (e.g. http://host:8080/run_code)")


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
