"""`actor_rollout_ref.rollout.*`: the engines' settings, RAGEN's rollout filter, and the sampling the trainer asks
the engines for (training and validation)."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.filters import RolloutFilterConfig
from megatron_cpo.config_checks import check, check_choice
from megatron_cpo.rollout.sync_check import SyncCheckConfig
from megatron_cpo.rollout.types import RolloutEngineConfig


@dataclass
class ValKwargsConfig:
    """How validation samples (verl's `rollout.val_kwargs`): greedy unless `do_sample`; with `do_sample`, `n`
    samples per prompt at `temperature` / `top_p` / `top_k`, and the accuracy is their mean (`mean@n`)."""
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    do_sample: bool = False
    n: int = 1

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.val_kwargs."
        check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        check(self.top_k == -1 or self.top_k > 0, f"{prefix}top_k={self.top_k} must be -1 (off) or > 0")


RAY_MODES = ("ray", "sync", "async")
"""The modes that spawn the engines as Ray actors: verl's `sync` and `async` mean `ray` here (the controller always
streams groups from asynchronous engines)."""
ROLLOUT_MODES = ("ray", "server", "colocate", "sync", "async")
"""`rollout.mode`: where the engines run (docs/launch.md)."""


@dataclass
class RolloutConfig(RolloutFilterConfig, RolloutEngineConfig):
    """`actor_rollout_ref.rollout`: the engines' settings (`RolloutEngineConfig` of rollout/types.py: count, layout,
    memory, Ray address, weight transport), RAGEN's rollout filter (`RolloutFilterConfig` of algorithms/filters.py,
    the `rollout_filter_*` keys, off by default; docs/filters.md) and the sampling the trainer asks for. This class
    extends both, so the engines and the filter receive this object as is.
    `n` responses per prompt at `temperature` / `top_p` / `top_k`; `val_kwargs` is how validation samples.
    `max_inflight_prompts` caps the prompts the controller keeps in flight (0: 2 * data.train_batch_size, or the
    k + 1 batches asynchronous training may hold, `async_training.max_staleness` = k).
    `log_prob_micro_batch_size_per_gpu`: responses per forward when the actor recomputes log-probs
    (0: `actor.ppo_micro_batch_size_per_gpu`).
    `free_cache_engine` (verl's name; `enable_sleep_mode` is accepted for it) puts colocated engines to sleep while
    the actor trains (`rollout.mode=colocate`, GPU engines only) and wakes them before rollout: `sleep_level` 1 frees
    the KV cache and moves the weights to host memory, 2 discards the weights too (new ones are pushed before the
    next rollout anyway, so 2 saves the copy and the host memory).
    `mode` (docs/launch.md): `ray` (default; verl's `sync`/`async` are aliases) spawns `num_engines` engines as Ray
    actors on their own devices; `server` uses running `megatron-cpo rollout` servers at `server_urls` (token in
    `server_token_file`; `server_timeout_s` bounds health checks and connecting) and never starts Ray; `colocate`
    starts one engine server per rollout-TP group of the trainer's ranks on their node, sharing their devices."""
    n: int = 4
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_inflight_prompts: int = 0
    log_prob_micro_batch_size_per_gpu: int = 0
    val_kwargs: ValKwargsConfig = field(default_factory=ValKwargsConfig)
    free_cache_engine: bool = True
    sleep_level: int = 1
    mode: str = "ray"
    server_urls: list[str] = field(default_factory=list)
    server_timeout_s: float = 30.0
    server_token_file: str = ""
    sync_check: SyncCheckConfig = field(default_factory=SyncCheckConfig)

    @property
    def log_prob_temperature(self) -> float:
        """The temperature the trainer scores responses at: the sampling one (the engines report log-probs at it);
        greedy rollouts (temperature 0) are scored at 1."""
        return self.temperature or 1.0

    def __post_init__(self) -> None:
        RolloutEngineConfig.__post_init__(self)
        RolloutFilterConfig.__post_init__(self)
        prefix = "actor_rollout_ref.rollout."
        check(self.log_prob_micro_batch_size_per_gpu >= 0, f"{prefix}log_prob_micro_batch_size_per_gpu="
               f"{self.log_prob_micro_batch_size_per_gpu} must be >= 0 (0: actor.ppo_micro_batch_size_per_gpu)")
        check(self.sleep_level in (1, 2), f"{prefix}sleep_level={self.sleep_level} must be 1 (free the KV cache, "
               "move the engine's weights to host memory) or 2 (discard the weights too)")
        check(self.n >= 1, f"{prefix}n={self.n} must be >= 1")
        check(self.temperature >= 0, f"{prefix}temperature={self.temperature} must be >= 0")
        check(0 < self.top_p <= 1, f"{prefix}top_p={self.top_p} must be in (0, 1]")
        check(self.max_inflight_prompts >= 0, f"{prefix}max_inflight_prompts={self.max_inflight_prompts} must be "
                                               ">= 0 (0 means 2 * data.train_batch_size, or (k + 1) * "
                                               "data.train_batch_size with async_training.max_staleness=k)")
        check_choice(prefix + "mode", self.mode, ROLLOUT_MODES)
        check(self.mode == "server" or not self.server_urls, f"{prefix}server_urls={self.server_urls} is only "
               f"used with {prefix}mode=server (mode={self.mode!r}); drop it or set mode=server")
        check(self.mode != "server" or bool(self.server_urls), f"{prefix}mode=server needs {prefix}server_urls="
               "[http://HOST:PORT, ...] (servers started with `megatron-cpo rollout`)")
        check(self.mode != "server" or bool(self.server_token_file), f"{prefix}mode=server needs "
               f"{prefix}server_token_file: the file holding the token the servers were started with (--token-file)")
        check(self.server_timeout_s > 0, f"{prefix}server_timeout_s={self.server_timeout_s} must be > 0")
