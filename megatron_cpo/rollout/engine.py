"""One vLLM engine inside a Ray actor: generates groups of samples, aborts them, reports health, loads weights.

The actor is asynchronous: every `generate` call is a coroutine awaiting vLLM's `AsyncLLM`, so many prompts are
batched by vLLM's scheduler while the controller receives each group as soon as its last sample finishes.
Every token carries the weight version that sampled it (vLLM's version spans, labelled at each reload), and a reload
may happen with groups still generating (`begin_weight_reload(in_flight=...)`, types.IN_FLIGHT_POLICIES).
The same code runs the CPU build of vLLM and the CUDA build; with tensor_model_parallel_size > 1, vLLM's multiprocessing
executor spreads the engine over the GPUs Ray assigned to this actor.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid

from megatron_cpo.rollout.buckets import BucketSpec
from megatron_cpo.rollout.scoring import ScoredGroup, ScoredResponse, ScoreRequest, extract_scores, score_params
from megatron_cpo.rollout.types import (
    IN_FLIGHT_POLICIES,
    EngineLaunchConfig,
    RolloutGroup,
    RolloutSample,
    SamplingParams,
    derive_sample_seeds,
)

WORKER_EXTENSION = "megatron_cpo.rollout.worker_extension.WeightReloadExtension"
PROCESS_CHECK_S = 1.0  # how often a pending weight RPC checks that the engine's processes are alive


class VLLMEngine:
    """Wrapped by `ray.remote` in the manager; constructing it starts the vLLM engine (tens of seconds)."""

    def __init__(self, config: EngineLaunchConfig, engine_index: int, pid_file: str | None = None) -> None:
        if pid_file is not None and os.path.isdir(os.path.dirname(pid_file)):  # the manager's host only
            # first, so the manager can end what this actor starts even if the actor never finishes starting
            with open(pid_file, "w") as file:
                file.write(f"{socket.gethostname()} {os.getpid()}")
        if not config.uses_gpu:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.kv_cache_space_gib))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=config.model_path,
            dtype=config.dtype,
            max_model_len=config.max_model_len,
            tensor_parallel_size=config.engines.tensor_model_parallel_size,
            distributed_executor_backend="mp" if config.engines.tensor_model_parallel_size > 1 else None,
            gpu_memory_utilization=config.engines.gpu_memory_utilization,
            max_num_seqs=config.max_num_seqs,
            enable_prefix_caching=config.enable_prefix_caching,
            logprobs_mode=config.logprobs_mode,
            max_logprobs=config.max_logprobs,
            worker_extension_cls=WORKER_EXTENSION,
            seed=config.seed + engine_index,
            enforce_eager=not config.uses_gpu,
            # vLLM's CPU sampler cannot rewind a seeded request's torch generator when a chunked prefill discards
            # its token ("CPU Generator does not use offset" kills the engine), so on CPU prompts are never chunked.
            enable_chunked_prefill=config.uses_gpu and config.engines.enable_chunked_prefill,
            max_num_batched_tokens=(config.engines.max_num_batched_tokens if config.uses_gpu
                                    else max(config.max_model_len, 2048)),
            enable_sleep_mode=config.uses_gpu and config.enable_sleep_mode,
        )
        self.engine_index = engine_index
        self.engine = AsyncLLM.from_engine_args(args)
        self._processes = _child_processes()
        self._active: dict[str, list[str]] = {}  # group request id -> its per-sample vLLM request ids
        self._weight_lock = asyncio.Lock()
        self._cancel_epoch = 0  # bumped by cancel_all: samples started before it end
        self._paused = False  # the scheduler is paused for a reload with requests in flight
        self._weights_ready = True  # no reload is open (samples aborted by a push wait for this)
        self._weights_changed = asyncio.Condition()

    def ready(self) -> int:
        return self.engine_index

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
                       ) -> RolloutGroup | None:
        """Generate the group's n samples (one vLLM request each, with its derived seed). Returns None when the
        group was cancelled by `cancel_all`."""
        sample_ids = [f"{request_id}/sample{i}" for i in range(params.n)]
        self._active[request_id] = list(sample_ids)  # the vLLM request ids now running (a continuation has its own)
        try:
            outputs = await asyncio.gather(*(
                self._generate_one(request_id, index, prompt_token_ids, params, seed)
                for index, seed in enumerate(params.sample_seeds())))
        finally:
            self._active.pop(request_id, None)
        if any(output is None for output in outputs):
            return None
        return RolloutGroup(request_id=request_id, prompt_token_ids=list(prompt_token_ids), samples=outputs,
                            engine_index=self.engine_index, finished_at=time.time())

    async def _generate_one(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams,
                            seed: int | None) -> RolloutSample | None:
        """One sample; None when cancelled. A sample aborted by a weight push in `partial` mode keeps its tokens and
        log-probs and goes on, once the new weights are in, as a new request of prompt + tokens so far (its seed
        derived from the original's and the attempt, so a sampled continuation does not replay the same draws)."""
        epoch = self._cancel_epoch
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        attempt = 0
        while True:
            vllm_id = self._active[request_id][index] = f"{request_id}/sample{index}" + (
                f"/continued{attempt}" if attempt else "")
            attempt_seed = seed if seed is None or attempt == 0 else derive_sample_seeds(seed, attempt + 1)[attempt]
            completion = await self._complete(vllm_id, list(prompt_token_ids) + tokens, dict(
                temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                max_tokens=params.max_tokens - len(tokens), stop_token_ids=list(params.stop_token_ids),
                seed=attempt_seed))
            if completion is None:
                return None
            tokens += completion.token_ids
            logprobs += _token_logprobs(completion)
            versions += _token_versions(completion)
            if completion.finish_reason in ("stop", "length"):
                return RolloutSample(token_ids=tokens, logprobs=logprobs, finish_reason=completion.finish_reason,
                                     truncated=completion.finish_reason == "length", policy_versions=versions)
            if completion.finish_reason != "abort" or epoch != self._cancel_epoch:
                return None  # cancelled, or failed
            # aborted by a weight push (in_flight="partial"): wait for the new weights, then continue
            async with self._weights_changed:
                await self._weights_changed.wait_for(lambda: self._weights_ready or epoch != self._cancel_epoch)
            if epoch != self._cancel_epoch:
                return None
            if len(tokens) >= params.max_tokens:
                return RolloutSample(token_ids=tokens, logprobs=logprobs, finish_reason="length", truncated=True,
                                     policy_versions=versions)
            attempt += 1

    async def sync_probe(self, prompts: list[list[int]], max_tokens: int) -> list[RolloutSample | None]:
        """Greedy continuations of `prompts` (`max_tokens` each: end-of-sequence does not stop them) with this
        engine's log-probs, for the trainer's sync check (rollout/sync_check.py). Not groups in flight: `cancel_all`
        never aborts them and they do not keep the engine from taking weights."""
        tag = uuid.uuid4().hex[:12]
        completions = await asyncio.gather(*(
            self._complete(f"sync-probe-{tag}-{index}", prompt, dict(temperature=0.0, max_tokens=max_tokens,
                                                                     ignore_eos=True))
            for index, prompt in enumerate(prompts)))
        return [RolloutSample(token_ids=list(c.token_ids), logprobs=_token_logprobs(c), finish_reason=c.finish_reason,
                              truncated=c.finish_reason == "length")
                if c is not None and c.finish_reason in ("stop", "length") else None for c in completions]

    async def score(self, request: ScoreRequest) -> ScoredGroup:
        """A distillation teacher's scores of each response after its prompt (rollout/scoring.py): one vLLM request
        per response, at temperature 1 with `request.topk` prompt log-probs. Not groups in flight (`cancel_all`
        leaves them alone)."""
        params, first, tag = score_params(request.topk), len(request.prompt_token_ids), uuid.uuid4().hex[:12]

        async def one(index: int, response: list[int]) -> ScoredResponse:
            if not response:
                return ScoredResponse([], [] if request.topk else None, [] if request.topk else None)
            sequence = list(request.prompt_token_ids) + list(response)
            final = None
            async for output in self.engine.generate({"prompt_token_ids": sequence}, params,
                                                     f"score-{tag}-{request.request_id}/{index}"):
                final = output
            return extract_scores(final.prompt_logprobs, sequence, first, request.topk)

        return ScoredGroup(request.request_id, list(await asyncio.gather(
            *(one(index, response) for index, response in enumerate(request.responses)))))

    async def _complete(self, vllm_id: str, prompt_token_ids: list[int], options: dict):
        """vLLM's final output (`CompletionOutput`) of one request (`options`: vLLM sampling parameters), or None
        when it returned none."""
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        vllm_params = VllmSamplingParams(n=1, logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
                                         **options)
        final = None
        async for output in self.engine.generate({"prompt_token_ids": list(prompt_token_ids)}, vllm_params, vllm_id):
            final = output
        return final.outputs[0] if final is not None and final.outputs else None

    async def cancel_all(self) -> int:
        """Abort every group in flight; their `generate` calls return None. Returns how many groups."""
        groups = list(self._active)
        sample_ids = [sample for group in groups for sample in self._active[group]]
        self._cancel_epoch += 1
        async with self._weights_changed:
            self._weights_changed.notify_all()  # samples waiting to continue after a push give up
        if sample_ids:
            await self.engine.abort(sample_ids)
        return len(groups)

    async def is_healthy(self) -> bool:
        """vLLM's own check, that every process the engine started (engine core, workers) still runs, and a round trip
        through them (each worker's `check_health`, by `collective_rpc`): an idle engine whose core was killed passes
        vLLM's check, and one whose core is stopped or deadlocked passes both but never answers the round trip (the
        caller bounds the wait: `engine_health.timeout_s`)."""
        await self.engine.check_health()
        self._raise_if_processes_gone()
        await self._unless_dead(self.engine.collective_rpc("check_health"))
        return True

    def _raise_if_processes_gone(self) -> None:
        gone = [process for process in self._processes if not _is_running(process)]
        if gone:
            raise RuntimeError(f"engine {self.engine_index}'s process {gone[0].pid} ({gone[0].name}) is gone; "
                               "see its log for why (often out of memory)")

    async def _unless_dead(self, call):
        """Await an RPC to the engine's workers, failing as soon as one of its processes is gone (a dead engine
        core never answers, so the weight sync would wait forever)."""
        task = asyncio.ensure_future(call)
        while True:
            done, _ = await asyncio.wait({task}, timeout=PROCESS_CHECK_S)
            if done:
                return task.result()
            try:
                self._raise_if_processes_gone()
            except RuntimeError:
                task.cancel()
                raise

    async def begin_weight_reload(self, in_flight: str = "none") -> None:
        """Open an in-place reload. `in_flight` (types.IN_FLIGHT_POLICIES) says what happens to the groups still
        generating; with any but `none` the scheduler stays paused until `finish_weight_reload`, so no decode step
        runs between the reload's calls, and the KV cache is dropped (continued requests recompute their prefix
        under the new weights)."""
        if in_flight not in IN_FLIGHT_POLICIES:
            raise ValueError(f"in_flight={in_flight!r}; choose one of {IN_FLIGHT_POLICIES}")
        if in_flight == "none" and self._active:
            raise RuntimeError(f"engine {self.engine_index} has {len(self._active)} groups in flight; weights can "
                               "only change when it is idle (cancel_all() or drain completed() first)")
        if in_flight != "none":
            self._weights_ready = False
            mode = {"finish": "wait", "partial": "abort", "keep": "keep"}[in_flight]
            await self._unless_dead(self.engine.pause_generation(mode=mode, clear_cache=True))
            self._paused = True
        await self._unless_dead(self.engine.collective_rpc("rollout_begin_weight_reload"))

    async def load_weight_bucket(self, spec: BucketSpec) -> int:
        async with self._weight_lock:
            counts = await self._unless_dead(
                self.engine.collective_rpc("rollout_load_weight_bucket", args=(spec.to_wire(),)))
        return counts[0]

    async def join_weight_group(self, name: str, host: str, port: int, first_rank: int, world_size: int,
                                timeout_s: float) -> list[int]:
        """Have every worker of this engine join a sending rank's weight-sync group (ranks first_rank..)."""
        return await self.engine.collective_rpc("rollout_join_weight_group",
                                                args=(name, host, port, first_rank, world_size, timeout_s))

    async def receive_weight_bucket(self, name: str, wire_entries: list, nbytes: int) -> int:
        """Receive one bucket broadcast over group `name` into every worker and load it."""
        async with self._weight_lock:
            counts = await self._unless_dead(self.engine.collective_rpc("rollout_receive_weight_bucket",
                                                                        args=(name, wire_entries, nbytes)))
        return counts[0]

    async def leave_weight_group(self, name: str | None = None) -> None:
        """Close weight-sync group `name` (every group when None) on every worker."""
        await self.engine.collective_rpc("rollout_leave_weight_group", args=(name,))

    async def finish_weight_reload(self, version: int | None = None, resume: bool = True) -> list[dict]:
        """Close the reload on every worker, drop the prefix cache (its keys and values were computed with the old
        weights), label the tokens sampled from now on with `version`, and let paused or aborted requests go on;
        with `resume=False` the samples a `partial` push aborted wait for `resume_generation`, so that the sync
        probe runs alone (vLLM's CPU kernels are not batch-invariant). The scheduler itself runs again either way
        (the probe needs it), so requests a `keep` push froze in it go on at once.
        Returns each worker's reload report (`worker_extension.ReloadLedger.report`), with `prefix_cache_reset`:
        whether vLLM dropped the cache (it refuses while requests hold cached blocks; requests paused by
        `begin_weight_reload` hold none, their KV cache was cleared)."""
        reports = await self._unless_dead(self.engine.collective_rpc("rollout_finish_weight_reload"))
        reset = bool(await self.engine.reset_prefix_cache())
        if version is not None:
            await self.engine.update_weight_version(str(version))
        if self._paused:
            await self.engine.resume_generation()
            self._paused = False
        if resume:
            await self.resume_generation()
        return [{**report, "prefix_cache_reset": reset} for report in reports]

    async def resume_generation(self) -> None:
        """Let the samples a push aborted continue on the new weights (after `finish_weight_reload(resume=False)`
        and the sync probe); nothing to do when none wait."""
        async with self._weights_changed:
            self._weights_ready = True
            self._weights_changed.notify_all()

    async def shutdown(self) -> None:
        """Leave every weight-sync group (closing the workers' sockets cleanly), then stop the engine."""
        try:
            await self.leave_weight_group()
        finally:
            self.engine.shutdown()

    async def sleep(self, level: int = 1) -> bool:
        """Free this engine's device memory while colocated training runs (vLLM's sleep mode; `level` 1 frees the
        KV cache and moves the weights to host memory, 2 discards them: push weights before generating again).
        Returns whether it slept; where it cannot (CPU, or started without sleep mode) it says why once."""
        if not self._can_sleep():
            return False
        if self._active:
            raise RuntimeError(f"engine {self.engine_index} has {len(self._active)} groups in flight; it can only "
                               "sleep when idle (cancel_all() or drain completed() first)")
        await self._unless_dead(self.engine.sleep(level))
        return True

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """Re-allocate what `sleep` freed (`tags`: vLLM's "weights" / "kv_cache" to wake in stages, None: all).
        Returns whether there was anything to wake."""
        if not self._can_sleep():
            return False
        await self._unless_dead(self.engine.wake_up(tags))
        return True

    def _can_sleep(self) -> bool:
        from megatron_cpo.rollout.sleep_mode import explain_once, platform_supports_sleep, why_not_sleeping

        reason = why_not_sleeping(self.engine.vllm_config.model_config.enable_sleep_mode, platform_supports_sleep())
        if reason is not None:
            explain_once(self.engine_index, reason)
        return reason is None


def _token_logprobs(completion) -> list[float]:
    """The log-prob of each sampled token of a vLLM completion (requested with `logprobs=0`)."""
    return [step[token].logprob for step, token in zip(completion.logprobs, completion.token_ids)]


def _token_versions(completion) -> list[int]:
    """The weight version of each token of a vLLM completion, from its version spans (labels set by
    `finish_weight_reload`; vLLM's initial label "default" counts as version 0)."""
    versions: list[int] = []
    for span in completion.weight_versions or ():
        label = str(span.version)
        versions += [int(label) if label.isdigit() else 0] * (span.end - span.start)
    return versions + [0] * (len(completion.token_ids) - len(versions))


class _ChildProcess:
    """A process of this actor's engine, remembered by pid, name and start time (so a reused pid is not it)."""

    def __init__(self, process) -> None:
        self.pid, self.name, self.create_time = process.pid, process.name(), process.create_time()


def _child_processes() -> list[_ChildProcess]:
    import psutil

    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            found.append(_ChildProcess(process))
        except psutil.Error:
            continue
    return found


def _is_running(child: _ChildProcess) -> bool:
    import psutil

    try:
        process = psutil.Process(child.pid)
        return process.create_time() == child.create_time and process.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
