"""Typed requests, results and configuration of the rollout engines.

These are the only types the trainer's controller needs: it submits a prompt (token ids) with `SamplingParams`,
and receives a `RolloutGroup` of `n` `RolloutSample`s when every sample of that prompt has finished.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from megatron_cpo import platform
from megatron_cpo.rollout.config import RolloutEngineConfig
from megatron_cpo.rollout.cpu_resources import auto_kv_cache_gib, available_memory_bytes

_MASK64 = (1 << 64) - 1


class RolloutEngineStartError(RuntimeError):
    """A rollout engine could not be created (bad model path, out of memory, start timeout...)."""


class RolloutEnginesLostError(RuntimeError):
    """Every rollout engine died while requests were outstanding; the message names the requests."""


class WeightPushInterruptedError(RolloutEnginesLostError):
    """A collective weight push broke off (an engine of its group died or hung): the engines that answer hold a
    partial update."""


def derive_sample_seeds(seed: int, n: int) -> list[int]:
    """Per-sample seeds of a group: a splitmix64 hash of (seed, index), so groups with nearby seeds do not share
    samples and a group's samples are the same whichever engine serves it."""
    seeds = []
    for index in range(n):
        z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        seeds.append((z ^ (z >> 31)) & 0x7FFFFFFF)
    return seeds


@dataclass
class SamplingParams:
    """How to sample the `n` completions of one prompt. temperature=0 is greedy; top_k=-1 disables top-k.

    With `seed` set, the group's samples are reproducible: sample i uses `derive_sample_seeds(seed, n)[i]`.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n={self.n}: a group needs at least one sample; set n >= 1")
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature} is negative; use 0 for greedy")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p} must lie in (0, 1]; use 1.0 to disable")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: use -1 to disable top-k or a positive k")
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens} must be >= 1")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)

    def sample_seeds(self) -> list[int | None]:
        """The seed of each of the n samples (None everywhere when the group is unseeded)."""
        if self.seed is None:
            return [None] * self.n
        return list(derive_sample_seeds(self.seed, self.n))


@dataclass
class EpisodeInfo:
    """How a multi-turn episode went (megatron_cpo/envs/): its turns, rewards, why it stopped and what its
    environment and tools did. The trajectory reward is `env_reward` (the per-turn rewards summed) plus
    `final_score` (the environment's own final score) or, when that is None, the data source's grader applied to
    `final_answer` (the last assistant message)."""

    agent: str
    turns: int  # assistant turns
    observations: int  # observation turns appended (user / tool messages)
    turn_rewards: list[float]
    final_score: float | None
    final_answer: str
    stop_reason: str  # done, a turn limit, a length limit, env_timeout, reset_error (envs/episode.py: STOP_REASONS)
    observation_tokens: int = 0
    tool_calls: dict[str, int] = field(default_factory=dict)  # by tool name
    tool_failures: dict[str, int] = field(default_factory=dict)  # by kind: malformed, unknown_tool, error, timeout
    env_errors: int = 0
    env_timeouts: int = 0
    env_seconds: float = 0.0
    template_check: str = "off"  # off, same, retokenized (same text, other ids), differs (other text)
    non_finite_rewards: list[str] = field(default_factory=list)  # NaN / inf rewards refused (scored 0), described

    @property
    def env_reward(self) -> float:
        return float(sum(self.turn_rewards))


@dataclass
class RolloutSample:
    """One completion: generated token ids, the engine's log-prob of each of them, why it stopped, and the weight
    version (`RolloutEngines.weight_version` when it was pushed) that sampled each token: a sample that was
    generating when weights were pushed carries two or more versions (docs/async.md).

    A multi-turn episode is one sample too: `token_ids` are every turn's sampled ids and the observations between
    them, `loss_mask` is 1 on the sampled ids and 0 on the observations (None: every token was sampled), the
    log-prob of an observation token is 0, and `episode` says how the episode went (None for a single answer)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (EOS or a stop token) or "length"
    truncated: bool  # True when generation hit max_tokens or the model's max length (an episode: a length limit)
    loss_mask: list[int] | None = None
    episode: EpisodeInfo | None = None
    policy_versions: list[int] | None = None  # one per token; None: all sampled by the weights of the current push


@dataclass
class RolloutGroup:
    """The n samples of one submitted prompt; `engine_index` says which engine produced them."""

    request_id: str
    prompt_token_ids: list[int]
    samples: list[RolloutSample]
    engine_index: int = -1
    finished_at: float | None = None  # the engine's wall clock (time.time()) when the last sample finished
    greedy_baseline: RolloutSample | None = None  # ReMax: the prompt's greedy answer (GreedyBaselineGenerator)


IN_FLIGHT_POLICIES = ("none", "finish", "partial", "keep")
"""What a weight push does with requests still generating (`RolloutEngines.begin_weight_sync(in_flight=...)`):
`none`: there may be none (the synchronous loop); `finish`: they finish on the old weights, the reload waits for
them; `partial`: they are aborted, their output so far kept, and continued (prompt + partial output) on the new
weights; `keep`: they stay paused in the engine's scheduler and continue on the new weights (vLLM's
`pause_generation(mode="keep")`). In every mode but `none` the engine's scheduler is paused from the first reload
call to the last, so no decode step ever runs on half-loaded weights; and the KV cache is dropped, so a continued
request recomputes its prefix under the new weights."""


@dataclass
class EngineLaunchConfig:
    """What one set of engines serves and how it starts: the user's `RolloutEngineConfig` (`engines`, held as given)
    plus the facts of the run (`model_path`, `dtype`, `max_model_len`, `seed`) and start-up details the YAML does
    not expose.

    `logprobs_mode` is vLLM's. "processed_logprobs" (the default, as in verl and NeMo-RL) are the log-probs of the
    distribution each token was sampled from: log-softmax of logits / temperature, after top-k/top-p (greedy requests
    get the plain log-softmax). That is what the trainer recomputes at `rollout.temperature` (it does not truncate, so
    with top-k/top-p the two differ by the truncation, which the importance weight then accounts for), and the
    behaviour policy the off-policy correction needs. vLLM's own default, "raw_logprobs", is the log-softmax before
    temperature: at any temperature but 1 every engine log-prob would differ from the trainer's.
    `max_num_seqs`: sequences one engine decodes at once (vLLM's scheduler limit; None keeps vLLM's default, 128 for
    an `AsyncLLM`). Each prompt in flight holds `n` of them, so the controller's look-ahead beyond
    max_num_seqs / n prompts only queues. On CPU each engine takes `cpus_per_engine` Ray CPU slots.
    `enable_sleep_mode` starts the engines able to sleep (free their memory) while colocated training runs, where
    vLLM's platform has sleep mode (not the CPU build: there sleep and wake-up do nothing; rollout/sleep_mode.py).
    """

    model_path: str
    engines: RolloutEngineConfig = field(default_factory=RolloutEngineConfig)
    dtype: str = "bfloat16"
    max_model_len: int = 4096
    seed: int = 0
    max_num_seqs: int | None = None
    cpus_per_engine: float = 1.0
    enable_prefix_caching: bool = True
    logprobs_mode: str = "processed_logprobs"
    weight_sync_bucket_mb: float = 256.0
    ray_namespace: str = "megatron_cpo_rollout"
    engine_start_timeout_s: float = 600.0
    engine_env: dict[str, str] = field(default_factory=dict)
    enable_sleep_mode: bool = False  # vLLM's sleep mode (GPU engines only): colocated engines free memory to train
    max_logprobs: int = 20  # vLLM's cap on (prompt) log-probs per position: a distillation teacher's top-k at least
    frozen_weights: bool = False  # a teacher's engines: never pushed to, so a restarted one serves once it is up

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model_path):
            raise ValueError(f"rollout model_path={self.model_path!r} is not a directory; point it at an HF model "
                             "directory (config.json + weights + tokenizer)")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"rollout dtype={self.dtype!r}; use float32, bfloat16 or float16")
        if self.max_num_seqs is not None and self.max_num_seqs < 1:
            raise ValueError(f"rollout max_num_seqs={self.max_num_seqs}; set it >= 1 or None for vLLM's default")
        if self.weight_sync_bucket_mb <= 0:
            raise ValueError(f"rollout weight_sync_bucket_mb={self.weight_sync_bucket_mb}; set a positive size")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"rollout logprobs_mode={self.logprobs_mode!r}; use raw_logprobs or processed_logprobs")
        if self.max_logprobs < 0:
            raise ValueError(f"rollout max_logprobs={self.max_logprobs}; set it >= 0 (a teacher's top-k or more)")
        if self.engine_start_timeout_s <= 0:
            raise ValueError(f"rollout engine_start_timeout_s={self.engine_start_timeout_s}; set a positive timeout")

    @property
    def health_timeout_s(self) -> float:
        """How long an engine may take to answer a ping (`engines.engine_health.timeout_s`); also the grace an
        engine's processes get to end."""
        return self.engines.engine_health.timeout_s

    @property
    def uses_gpu(self) -> bool:
        return platform.has_cuda()

    @property
    def kv_cache_space_gib(self) -> int:
        """vLLM's CPU KV cache size (`VLLM_CPU_KVCACHE_SPACE`, whole GiB): `engines.kv_cache_gib` rounded up, or for
        `auto` sized for this model and the memory free now (rollout/cpu_resources.py)."""
        if self.engines.kv_cache_gib == "auto":
            return auto_kv_cache_gib(self.model_path, self.dtype, self.max_model_len, self.max_num_seqs,
                                     self.engines.num_engines, available_memory_bytes())
        return max(1, math.ceil(self.engines.kv_cache_gib))

    @property
    def weight_sync_bucket_bytes(self) -> int:
        return int(self.weight_sync_bucket_mb * 1024 * 1024)
