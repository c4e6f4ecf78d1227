"""The rollout controller's view of the engines: submit prompts, stream finished groups, survive engine deaths.

Lives on trainer rank 0. It joins or starts a Ray cluster (`ray_cluster.connect_ray`), spawns `num_engines` vLLM
engine actors, sends each prompt to the least-loaded live engine and yields groups in the order they finish. When an
engine dies, the prompts it held are sent again to the others, so every submitted prompt comes back exactly once;
when no engine is left, `RolloutEnginesLostError` names the prompts that could not be served.
A death is logged once (a warning naming the engine) and `num_engines_alive()` counts the survivors; weight syncs
skip dead engines. Each engine actor records its host and pid when it starts, so `shutdown()` can end the processes
it started (vLLM's engine core, its workers) even when the actor is killed before it finished starting (SIGTERM
during start-up).
"""
from __future__ import annotations

import atexit
import logging
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable
from pathlib import Path

import torch

from megatron_cpo.rollout.dispatch import EngineRequest, RequestBook
from megatron_cpo.rollout.engine import VLLMEngine
from megatron_cpo.rollout.processes import end_processes, engine_processes
from megatron_cpo.rollout.ray_cluster import connect_ray
from megatron_cpo.rollout.scoring import ScoredGroup, ScoreRequest
from megatron_cpo.rollout.types import (
    EngineLaunchConfig,
    RolloutEnginesLostError,
    RolloutEngineStartError,
    RolloutGroup,
)
from megatron_cpo.rollout.weight_sync import (
    WeightSender,
    WeightSenderSpec,
    close_weight_groups,
    resolve_weight_transport,
)

logger = logging.getLogger(__name__)


def _connect_ray(config: EngineLaunchConfig) -> bool:
    """`connect_ray`, keeping the caller's SIGTERM handler (the trainer's stop logic): `ray.init` installs one that
    calls sys.exit."""
    if threading.current_thread() is not threading.main_thread():
        return connect_ray(config.engines.ray_address, config.ray_namespace)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        return connect_ray(config.engines.ray_address, config.ray_namespace)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class RolloutManager(RequestBook):
    """Engines behind one submit / completed interface. Use as a context manager or call `shutdown()`."""

    def __init__(self, config: EngineLaunchConfig) -> None:
        import ray

        self.config = config
        self._owns_ray = _connect_ray(config)
        self._name_prefix = f"rollout-engine-{uuid.uuid4().hex[:8]}"
        self.engine_names = tuple(f"{self._name_prefix}-{i}" for i in range(config.engines.num_engines))
        self.engines: list = []
        self._alive: list[bool] = []
        self._ready: list[bool] = []
        self._pid_dir = Path(tempfile.mkdtemp(prefix="rollout-engine-pids-"))
        self._pending: dict = {}  # Ray ObjectRef -> EngineRequest
        self._scoring: dict = {}  # Ray ObjectRef -> (ScoreRequest, engine index): a distillation teacher's requests
        self._closed = False
        self.last_engine_failure: str | None = None
        self.weight_version = 0  # weight pushes completed (finish_weight_sync)
        atexit.register(self.shutdown)
        try:
            self.weight_transport = resolve_weight_transport(config.engines.weight_transport)
            self._spawn_engines(ray)
        except BaseException:
            self.shutdown()
            raise

    def _spawn_engines(self, ray) -> None:
        resources = ({"num_gpus": self.config.engines.tensor_model_parallel_size, "num_cpus": 1} if self.config.uses_gpu
                     else {"num_cpus": self.config.cpus_per_engine})
        actor_cls = ray.remote(VLLMEngine)
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.config.kv_cache_space_gib), **self.config.engine_env}
        for index, name in enumerate(self.engine_names):
            self.engines.append(actor_cls.options(name=name, namespace=self.config.ray_namespace,
                                                  max_concurrency=10_000, runtime_env={"env_vars": env},
                                                  **resources).remote(self.config, index,
                                                                      str(self._pid_dir / f"{index}.pid")))
        self._alive = [True] * len(self.engines)
        self._ready = [False] * len(self.engines)
        readiness = [engine.ready.remote() for engine in self.engines]
        for index, ref in enumerate(readiness):
            try:
                ray.get(ref, timeout=self.config.engine_start_timeout_s)
                self._ready[index] = True
            except ray.exceptions.GetTimeoutError:
                raise RolloutEngineStartError(
                    f"rollout engine {index} ({self.config.model_path}) did not start within "
                    f"rollout.engine_start_timeout_s={self.config.engine_start_timeout_s}s; check that Ray has "
                    f"free resources for it ({resources}) or raise the timeout") from None
            except ray.exceptions.RayError as err:
                raise RolloutEngineStartError(
                    f"rollout engine {index} failed to start for model {self.config.model_path!r}: "
                    f"{_root_cause(err)}") from err

    # --- generation -----------------------------------------------------------------------------------------
    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait (at most `timeout` per group, as `completed`) until a group finishes, then return it with every
        other group already finished, so a caller can score them together; [] when nothing is outstanding."""
        import ray

        while self._pending:
            first = self._wait_one(timeout)
            ready, _ = ray.wait(list(self._pending), num_returns=len(self._pending), timeout=0)
            refs = [first, *(ref for ref in ready if ref != first)]
            groups = [group for group in map(self._take, refs) if group is not None]
            if groups:
                return groups
        return []

    def cancel_all(self) -> int:
        """Abort everything outstanding on every engine; returns how many groups were dropped."""
        import ray

        dropped = list(self._pending)
        self._pending.clear()
        live = [engine for engine, alive in zip(self.engines, self._alive) if alive]
        ray.wait([engine.cancel_all.remote() for engine in live], num_returns=len(live),
                 timeout=self.config.health_timeout_s)
        ray.wait(dropped, num_returns=len(dropped), timeout=self.config.health_timeout_s)
        return len(dropped)

    def health(self) -> list[bool]:
        """Whether each engine answers a health check within `health_timeout_s` (dead engines stay False)."""
        return [self._alive[i] and self._engine_is_healthy(i) for i in range(len(self.engines))]

    def check_engines(self) -> int:
        """Health-check every live engine, mark the ones that fail as dead (logged once); returns how many live."""
        for index in self._live_indices():
            problem = self._health_problem(index)
            if problem is not None:
                self._mark_dead(index, RuntimeError(f"failed its health check: {problem}"))
        return self.num_engines_alive()

    # --- scoring (a distillation teacher's engines) ------------------------------------------------------------
    def submit_score(self, request: ScoreRequest) -> None:
        """Score a group's responses on the least-loaded live engine (`VLLMEngine.score`); `collect_scores` returns
        it. Apart from the generation requests: `finished()` and `cancel_all()` never see it."""
        live = self._live_indices()
        if not live:
            raise RolloutEnginesLostError(f"all {len(self.engines)} teacher engines are dead (last failure: "
                                          f"{self.last_engine_failure}); request {request.request_id!r} cannot be "
                                          "scored")
        load = {i: 0 for i in live}
        for _, index in self._scoring.values():
            load[index] = load.get(index, 0) + 1
        index = min(live, key=lambda i: (load[i], i))
        self._scoring[self.engines[index].score.remote(request)] = (request, index)

    def collect_scores(self, request_ids: Iterable[str] | None = None, timeout: float | None = None
                       ) -> dict[str, ScoredGroup]:
        """Wait for the submitted scoring requests `request_ids` (None: all) and return them by id; the requests of
        an engine that died are scored again on the others. TimeoutError after `timeout` s without progress."""
        import ray

        wanted = set(request_ids) if request_ids is not None else {r.request_id for r, _ in self._scoring.values()}
        done: dict[str, ScoredGroup] = {}
        while wanted - done.keys():
            refs = [ref for ref, (request, _) in self._scoring.items() if request.request_id in wanted]
            if not refs:
                raise KeyError(f"scoring requests {sorted(wanted - done.keys())[:5]} were never submitted")
            ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
            if not ready:
                raise TimeoutError(f"no scoring request finished within {timeout}s; {len(refs)} outstanding")
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
            for ref in ready:
                request, index = self._scoring.pop(ref)
                try:
                    done[request.request_id] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    if self._alive[index] and self._engine_is_healthy(index):
                        raise
                    self._mark_dead(index, err)
                    self.submit_score(request)
        return done

    # --- weights --------------------------------------------------------------------------------------------
    def sender_spec(self, transport: str | None = None) -> WeightSenderSpec:
        """What other trainer ranks need to push their own layers (see `weight_sync`). `transport` ("shm" or
        "collective") overrides the configured one, e.g. to compare both on the same engines."""
        import ray

        names = tuple(name for name, alive in zip(self.engine_names, self._alive) if alive)
        return WeightSenderSpec(ray_address=ray.get_runtime_context().gcs_address,
                                ray_namespace=self.config.ray_namespace, engine_names=names,
                                bucket_bytes=self.config.weight_sync_bucket_bytes,
                                transport=resolve_weight_transport(transport or self.weight_transport),
                                workers_per_engine=self.config.engines.tensor_model_parallel_size,
                                timeout_s=self.config.engines.weight_sync_timeout_s)

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        """Open an in-place reload on every live engine. `in_flight` (types.IN_FLIGHT_POLICIES) says what happens to
        the requests still outstanding; with `none` there must be none."""
        if in_flight == "none" and self._pending:
            raise RuntimeError(f"{len(self._pending)} rollout requests are outstanding; weights can only change "
                               "between rounds: drain completed() or call cancel_all() first")
        self._call_live_engines("begin_weight_reload", in_flight)

    def finish_weight_sync(self, resume: bool = True) -> dict[str, list[dict]]:
        """Close the reload (layers that received no tensors keep their weights), clear the prefix cache, and count
        the push: tokens sampled from now on carry `weight_version`. With `resume=False` the requests the push
        paused wait for `resume_generation` (the sync probe runs alone first). Returns each live engine's reload
        report per worker (tensors received, parameters missing, names sent twice; see
        `weight_sync.reload_problem`), by engine name."""
        self.weight_version += 1
        reports = self._call_live_engines("finish_weight_reload", self.weight_version, resume)
        return {f"engine {index}": worker_reports for index, worker_reports in reports.items()}

    def resume_generation(self) -> None:
        """Let the requests paused by a push finished with `resume=False` go on (`VLLMEngine.resume_generation`)."""
        self._call_live_engines("resume_generation")

    def sync_probe(self, prompts: list[list[int]], max_tokens: int) -> list[RolloutGroup]:
        """Every live engine's greedy continuation of each prompt, with its log-probs (rollout/sync_check.py): one
        group per engine and prompt, `request_id` "engine <i>, prompt <j>". Outside the request book: `finished()`
        never returns these requests and `cancel_all()` never aborts them. An engine that fails and is unhealthy is
        marked dead and left out."""
        answers = self._call_live_engines("sync_probe", prompts, max_tokens)
        return [RolloutGroup(request_id=f"engine {index}, prompt {j}", prompt_token_ids=list(prompt), samples=[sample],
                             engine_index=index)
                for index, samples in answers.items() for j, (prompt, sample) in enumerate(zip(prompts, samples))
                if sample is not None]

    def _call_live_engines(self, method: str, *args) -> dict[int, object]:
        """Call `method(*args)` on every live engine; returns each answer by engine index. An engine that fails and
        is unhealthy is marked dead (an error of a healthy engine is raised); `RolloutEnginesLostError` when none
        is left."""
        import ray

        live = self._live_indices()
        refs = [getattr(self.engines[i], method).remote(*args) for i in live]
        answers = {}
        for index, ref in zip(live, refs):
            try:
                answers[index] = ray.get(ref, timeout=self.config.engines.weight_sync_timeout_s)
            except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError) as err:
                if self._engine_is_healthy(index):
                    raise
                self._mark_dead(index, err)
        if not self._live_indices():
            raise RolloutEnginesLostError(
                f"all {len(self.engines)} rollout engines are dead (last failure: {self.last_engine_failure}); "
                f"{method} cannot run. Create a new RolloutManager")
        return answers

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], transport: str | None = None,
                     in_flight: str = "none", resume: bool = True) -> dict[str, float]:
        """Load HF-named full tensors (all of them from this rank) into every engine; returns bytes, seconds,
        buckets and tensors. With several sending ranks use begin/finish_weight_sync and `WeightSender`.
        `transport` overrides the configured one (see `sender_spec`); `resume` as in `finish_weight_sync`."""
        start = time.perf_counter()
        self.begin_weight_sync(in_flight)
        live = self._live_indices()
        sender = WeightSender(self.sender_spec(transport), engine_handles=[self.engines[i] for i in live])
        metrics = sender.send(named_tensors)
        self.finish_weight_sync(resume)
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # --- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every engine and, when this manager started Ray, Ray itself. Safe to call twice."""
        import ray

        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        children = engine_processes(self._pid_dir)
        if ray.is_initialized():
            close_weight_groups(self.engine_names)
            stops = [engine.shutdown.remote() for engine, alive, ready in zip(self.engines, self._alive, self._ready)
                     if alive and ready]
            ray.wait(stops, num_returns=len(stops), timeout=self.config.health_timeout_s)
            for engine in self.engines:
                ray.kill(engine)
            if self._owns_ray:
                ray.shutdown()
        self._pending.clear()
        self._scoring.clear()
        end_processes(children, self.config.health_timeout_s)
        shutil.rmtree(self._pid_dir, ignore_errors=True)

    # --- internals ------------------------------------------------------------------------------------------
    def _requests(self) -> list[EngineRequest]:
        return list(self._pending.values())

    def _dispatch(self, request: EngineRequest) -> None:
        live = self._live_indices()
        if not live:
            lost = sorted({request.request_id, *(r.request_id for r in self._pending.values())})
            raise RolloutEnginesLostError(
                f"all {len(self.engines)} rollout engines are dead (last failure: {self.last_engine_failure}); "
                f"{len(lost)} requests could not be served: {lost[:20]}{' ...' if len(lost) > 20 else ''}. "
                "Create a new RolloutManager and resubmit them")
        load = {i: 0 for i in live}
        for pending in self._pending.values():
            if pending.engine_index in load:
                load[pending.engine_index] += 1
        request.engine_index = min(live, key=lambda i: (load[i], i))
        ref = self.engines[request.engine_index].generate.remote(request.request_id, request.prompt_token_ids,
                                                                 request.params)
        self._pending[ref] = request

    def _wait_one(self, timeout: float | None):
        """The ref of a finished request (not yet taken); TimeoutError after `timeout` seconds."""
        import ray

        ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=timeout)
        if not ready:
            raise TimeoutError(f"no rollout group finished within {timeout}s; {len(self._pending)} "
                               "requests outstanding (raise the timeout or check health())")
        return ready[0]

    def _take(self, ref) -> RolloutGroup | None:
        """A finished request's group; None when it was cancelled or its engine died (then it is re-dispatched)."""
        import ray

        request = self._pending.pop(ref)
        try:
            return ray.get(ref)
        except ray.exceptions.RayError as err:
            if self._alive[request.engine_index] and self._engine_is_healthy(request.engine_index):
                raise
            self._mark_dead(request.engine_index, err)
            self._dispatch(request)
            return None

    def _engine_is_healthy(self, index: int) -> bool:
        return self._health_problem(index) is None

    def _health_problem(self, index: int) -> str | None:
        """None when engine `index` answers its health check in time, else why not (one line)."""
        import ray

        try:
            ray.get(self.engines[index].is_healthy.remote(), timeout=self.config.health_timeout_s)
            return None
        except ray.exceptions.GetTimeoutError:
            return f"no answer within rollout health_timeout_s={self.config.health_timeout_s}s"
        except ray.exceptions.RayError as err:
            return _root_cause(err)

    def _mark_dead(self, index: int, err: BaseException) -> None:
        if self._alive[index]:
            self._alive[index] = False
            cause = _root_cause(err)
            self.last_engine_failure = f"engine {index} ({self.engine_names[index]}): {cause}"
            logger.warning("rollout engine %d (%s) died; %d of %d engines left (rollout/engines_alive): %s", index,
                           self.engine_names[index], self.num_engines_alive(), len(self.engines), cause)


def _root_cause(err: BaseException) -> str:
    """The innermost error of a Ray failure (the actor's own exception and its detail lines, not Ray's wrapper)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if "Error" in lines[index] or "Exception" in lines[index]:
            return " | ".join(lines[index:index + 4])
    return lines[-1] if lines else type(err).__name__
