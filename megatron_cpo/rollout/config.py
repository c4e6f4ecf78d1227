"""`actor_rollout_ref.rollout.*`: the engines' settings (`RolloutEngineConfig`), RAGEN's rollout filter, the
sampling the trainer asks the engines for (training and validation) and the sync check (`SyncCheckConfig`, applied
by sync_check.py). Torch-free: loading a config imports no torch."""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_cpo.algorithms.config import RolloutFilterConfig
from megatron_cpo.config_checks import check, check_choice

# Default tolerance per dtype of the weights (trainer and engine use the same: actor.megatron.params_dtype with `auto`
# resolved), in log-prob units (nats) on the probe's greedy tokens; measurements in docs/launch.md, "Is the engine in
# sync?".
# float32: engines in sync differ by <= 1e-6 (tiny models, first steps) and <= 3.1e-5 (SmolLM2-135M), but by up to
# 1.0e-4 (RLOO, step 38) and 2.0e-4 (PPO, step 26) once training at lr 1e-3 has made the tiny model's logits peaked:
# false stops at the former 1e-4 and 2e-4. An engine that kept its tied head showed 0.33 after the first push at lr
# 3e-2 (tiny) and 2.6e-4 / 3.9e-4 after the first two pushes at lr 1e-6 (SmolLM2): at 1e-3 such a small per-push
# change is caught only once it has added up, which the reload report (every parameter filled) does not wait for.
# 16-bit: engines in sync differ by up to 0.03 (tiny) and 0.11 (SmolLM2-135M), since the two sides' kernels round
# differently; only a stale engine whose weights moved far stands out (float16: not measured here, the bfloat16
# value, which has fewer mantissa bits, is kept).
DEFAULT_TOLERANCES = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.5}

DEFAULT_PROMPTS = ("Compute 17 + 25.", "Write one sentence about a lighthouse.")


@dataclass
class SyncCheckConfig:
    """`actor_rollout_ref.rollout.sync_check`: compare the engines with the trainer on a fixed probe after pushes.

    `enable`: run the check (and fail a push whose engines report a trainer tensor missing or sent twice).
    `every_n_pushes`: check the push before training and then every n-th push (1: every push; the probe costs a
    few greedy tokens per engine and one small forward of the actor: ~0.1 s on the tiny models, ~1-2 s on
    SmolLM2-135M on CPU, see docs/launch.md).
    `prompts`: the probe's prompts (chat template applied when the tokenizer has one); `max_tokens`: greedy tokens
    per prompt (the end-of-sequence token does not stop them).
    `tolerance`: the largest |engine - trainer| log-prob difference accepted; 0 takes the default of the weights'
    dtype (`DEFAULT_TOLERANCES`).
    """
    enable: bool = True
    every_n_pushes: int = 1
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    max_tokens: int = 8
    tolerance: float = 0.0

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.sync_check."
        check(self.every_n_pushes >= 1,
              f"{prefix}every_n_pushes={self.every_n_pushes} must be >= 1 (1: check every push)")
        check(self.max_tokens >= 1, f"{prefix}max_tokens={self.max_tokens} must be >= 1")
        check(not self.enable or any(text.strip() for text in self.prompts),
              f"{prefix}prompts is empty; give at least one prompt or set {prefix}enable=false")
        check(self.tolerance >= 0, f"{prefix}tolerance={self.tolerance} must be >= 0 (0: the default of the dtype)")

    def tolerance_for(self, dtype: str) -> float:
        """The configured tolerance, or the default for weights of `dtype` ("float32", "bfloat16", "float16")."""
        if self.tolerance > 0:
            return self.tolerance
        check(dtype in DEFAULT_TOLERANCES, f"no default sync-check tolerance for dtype {dtype!r}; set "
                                           "actor_rollout_ref.rollout.sync_check.tolerance")
        return DEFAULT_TOLERANCES[dtype]

    def due(self, push: int) -> bool:
        """Whether push number `push` (0: the push before training) is checked."""
        return self.enable and push % self.every_n_pushes == 0


@dataclass
class EngineHealthConfig:
    """`actor_rollout_ref.rollout.engine_health`: finding engines that hang or die, and starting new ones in their
    place (rollout/health.py; docs/launch.md, "Engines that hang or die").

    While the trainer waits for groups, every live engine is pinged each `check_interval_s` seconds: a round trip
    through vLLM's engine core and every worker (a server's `/health` in server mode). An engine whose ping is not
    answered within `timeout_s` (a stopped or deadlocked process, a device that stopped answering), or that dies, is
    given up within `check_interval_s + timeout_s`: logged once, its prompts re-sent to the others, its processes
    ended. `stall_timeout_s` (0: off) also gives up an engine that answers pings but finished none of its requests
    for that long (seconds spent waiting on the engines) while other engines finished groups; keep it above the
    longest time one group may take. `restart` starts a new engine in a given-up engine's place (Ray mode), at most
    `max_restarts_per_engine` times per engine and `max_restarts` times per run; it takes its first weights at the
    next weight push, with the sync check, before it gets requests. slime's `--rollout-health-check-interval` /
    `--rollout-health-check-timeout` are `check_interval_s` / `timeout_s`.
    """
    check_interval_s: float = 10.0
    timeout_s: float = 30.0
    stall_timeout_s: float = 1800.0
    restart: bool = True
    max_restarts_per_engine: int = 3
    max_restarts: int = 10

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout.engine_health."
        check(self.check_interval_s > 0, f"{prefix}check_interval_s={self.check_interval_s} must be > 0 (seconds "
                                         "between pings of an engine while the trainer waits on it)")
        check(self.timeout_s > 0, f"{prefix}timeout_s={self.timeout_s} must be > 0 (seconds an engine may take to "
                                  "answer a ping)")
        check(self.stall_timeout_s >= 0, f"{prefix}stall_timeout_s={self.stall_timeout_s} must be >= 0 (0: off)")
        check(self.max_restarts_per_engine >= 0 and self.max_restarts >= 0,
              f"{prefix}max_restarts_per_engine={self.max_restarts_per_engine} and max_restarts={self.max_restarts} "
              f"must be >= 0 (set {prefix}restart=false to never restart)")


@dataclass
class RolloutEngineConfig:
    """The user's settings of the rollout engines (keys of `actor_rollout_ref.rollout`, whose config extends this
    class): how many engines, their layout and memory, where they run and how weights reach them.

    `tensor_model_parallel_size`: GPUs per engine (vLLM's tensor parallelism). On CPU each engine takes
    `kv_cache_gib` GiB of KV cache (rounded up to whole GiB; `auto`: what its sequences can fill, within a quarter of
    the memory free when the engines start, rollout/cpu_resources.py); on GPU `gpu_memory_utilization` of its GPUs'
    memory.
    `enable_chunked_prefill` / `max_num_batched_tokens` (tokens one scheduler step may process) are vLLM's options
    on GPU; CPU engines never chunk prefills and take max(max_model_len, 2048) tokens per step (see engine.py).
    `ray_address`: "auto" joins the Ray cluster named by `RAY_ADDRESS` when it is set (the SLURM launcher sets it)
    and otherwise starts a private local one, never a cluster merely found on the machine; "local" always starts a
    private local cluster; "host:port" joins that cluster (`ray_cluster.resolve_ray_address`).
    `weight_transport`: how synced weights reach the engines: "shm" (/dev/shm buckets; engines on the sending rank's
    node), "collective" (a gloo/NCCL group between each sending rank and every engine worker; any node), or "auto"
    (collective when the Ray cluster or the trainer spans several nodes, else shm). `weight_sync_timeout_s` bounds
    forming that group and each broadcast, and each engine's part of a push: an engine that takes longer to load a
    bucket is dropped from the push (and given up when it does not answer a ping), the others complete it.
    `engine_health`: finding engines that hang or die and restarting them (`EngineHealthConfig`).
    """

    num_engines: int = 1
    tensor_model_parallel_size: int = 1
    kv_cache_gib: float | str = "auto"
    gpu_memory_utilization: float = 0.6
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int = 8192
    ray_address: str = "auto"
    weight_transport: str = "auto"
    weight_sync_timeout_s: float = 300.0
    engine_health: EngineHealthConfig = field(default_factory=EngineHealthConfig)

    def __post_init__(self) -> None:
        prefix = "actor_rollout_ref.rollout."
        if self.num_engines < 1:
            raise ValueError(f"{prefix}num_engines={self.num_engines} must be >= 1")
        if self.tensor_model_parallel_size < 1:
            raise ValueError(f"{prefix}tensor_model_parallel_size={self.tensor_model_parallel_size} must be >= 1")
        if self.kv_cache_gib != "auto":
            given = self.kv_cache_gib
            try:
                self.kv_cache_gib = float(given)
            except (TypeError, ValueError):
                self.kv_cache_gib = 0.0
            if not self.kv_cache_gib > 0:
                raise ValueError(f"{prefix}kv_cache_gib={given!r} must be > 0 (GiB of KV cache per CPU engine) or "
                                 "auto (sized from the model and the free memory)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"{prefix}gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"{prefix}max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1")
        if self.weight_transport not in ("auto", "shm", "collective"):
            raise ValueError(f"{prefix}weight_transport={self.weight_transport!r} is not supported; choose one of "
                             "'auto', 'shm', 'collective'")
        if not self.weight_sync_timeout_s > 0:
            raise ValueError(f"{prefix}weight_sync_timeout_s={self.weight_sync_timeout_s} must be > 0")



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
    """`actor_rollout_ref.rollout`: the engines' settings (`RolloutEngineConfig`: count, layout, memory, Ray address,
    weight transport), RAGEN's rollout filter (`RolloutFilterConfig` of algorithms/config.py,
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
