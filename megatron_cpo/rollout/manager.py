"""The rollout controller's view of the engines: submit prompts, stream finished groups, survive engines that die
or hang, and restart them.

Lives on trainer rank 0. It joins or starts a Ray cluster (`ray_cluster.connect_ray`), spawns `num_engines` vLLM
engine actors, sends each prompt to the least-loaded live engine and yields groups in the order they finish. While
it waits it pings the live engines and gives up one that dies, does not answer in time or stalls
(`engine_health`, health.py): logged once, its actor and processes ended, the prompts it held sent again to the
others, so every submitted prompt comes back exactly once; when no engine is left, `RolloutEnginesLostError` names
the prompts that could not be served. Within the restart budget a new engine is started in the given-up engine's
slot; it joins at the next weight push (`begin_weight_sync` includes it, so the push and the sync check that follows
reach it) and gets requests only after that push: an engine that has not served the current weights never
samples (a distillation teacher's engines, `frozen_weights`, load their own weights and serve once up; their
scoring requests: ray_scoring.py). `num_engines_alive()` counts the engines serving requests, `engine_restarts`
the restarts started. Each engine actor records its host and pid when it starts, so its processes (vLLM's engine
core, its workers) can be ended even when the actor is killed before it finished starting (SIGTERM during start-up).
"""
from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

import torch

from megatron_cpo.rollout.dispatch import TICK_S, EngineRequest, RequestBook, send_queued
from megatron_cpo.rollout.engine_actors import EngineActors, root_cause
from megatron_cpo.rollout.health import EngineWatch, RestartBudget
from megatron_cpo.rollout.processes import end_processes
from megatron_cpo.rollout.ray_cluster import connect_ray
from megatron_cpo.rollout.ray_scoring import RayScoreBook
from megatron_cpo.rollout.types import (
    EngineLaunchConfig,
    RolloutEnginesLostError,
    RolloutGroup,
)
from megatron_cpo.rollout.weight_sync import WeightSender, WeightSenderSpec, resolve_weight_transport

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


class RolloutManager(RequestBook, RayScoreBook):
    """Engines behind one submit / completed interface. Use as a context manager or call `shutdown()`."""

    def __init__(self, config: EngineLaunchConfig) -> None:
        self.config = config
        self.health_config = config.engines.engine_health
        count = config.engines.num_engines
        self._alive: list[bool] = [True] * count
        self._pending: dict = {}  # Ray ObjectRef -> EngineRequest
        self._orphans: list[EngineRequest] = []  # requests of given-up engines, sent again at the next look
        self._scoring: dict = {}  # Ray ObjectRef -> (ScoreRequest, engine index): a distillation teacher's requests
        self._score_orphans: list = []  # scoring requests of given-up engines (ray_scoring.py)
        self._closed = False
        self._failures: dict[int, str] = {}  # why each given-up engine slot was (cleared when it serves again)
        self.weight_version = 0  # weight pushes completed (finish_weight_sync)
        self.rejoined: tuple[int, ...] = ()  # engines whose first weights came with the last push
        self._watch = EngineWatch(self.health_config, count)
        self._restarts = RestartBudget(self.health_config, count)
        self._pings: dict[int, Any] = {}  # engine -> ObjectRef of its health check in flight
        self._joining: set[int] = set()  # restarted engines that are up and wait for a push
        self._owns_ray = _connect_ray(config)
        self.actors = EngineActors(config, self._restarts)
        atexit.register(self.shutdown)
        try:
            self.weight_transport = resolve_weight_transport(config.engines.weight_transport)
            self.actors.start_all()
        except BaseException:
            self.shutdown()
            raise

    @property
    def engines(self) -> list:
        """The actor of each engine slot (a given-up one stays until its replacement is up)."""
        return self.actors.handles

    @property
    def engine_names(self) -> tuple[str, ...]:
        return self.actors.names

    @property
    def last_engine_failure(self) -> str | None:
        """Why the engines not serving now were given up (and whether they are restarted), the latest last."""
        return "; ".join(self._failures.values()) or None

    @property
    def engine_restarts(self) -> int:
        """Engines started in place of given-up ones during this manager's life."""
        return self._restarts.total

    def num_engines_restarting(self) -> int:
        """Engines started in place of given-up ones that have not yet taken their first weights."""
        return len(self.actors.replacements) + len(self._joining)

    # --- generation -----------------------------------------------------------------------------------------
    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait (at most `timeout` per group, as `completed`) until a group finishes, then return it with every
        other group already finished, so a caller can score them together; [] when nothing is outstanding."""
        import ray

        while self._outstanding():
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
        count = len(dropped) + len(self._orphans)
        self._pending.clear()
        self._orphans.clear()
        live = [self.engines[i] for i in self._live_indices()]
        ray.wait([engine.cancel_all.remote() for engine in live], num_returns=len(live),
                 timeout=self.config.health_timeout_s)
        ray.wait(dropped, num_returns=len(dropped), timeout=self.config.health_timeout_s)
        return count

    def health(self) -> list[bool]:
        """Whether each engine serves requests and answers a health check within `health_timeout_s`."""
        return [self._alive[i] and self._health_problem(i) is None for i in range(len(self.engines))]

    def check_engines(self) -> int:
        """Health-check the live engines at once and give up those that fail (logged once); returns how many
        engines the next push reaches: the live ones and those restarting in place of given-up ones."""
        self._check_replacements()
        self._check_at_once(self._live_indices())
        return self.num_engines_alive() + self.num_engines_restarting()

    # --- weights --------------------------------------------------------------------------------------------
    def sender_spec(self, transport: str | None = None) -> WeightSenderSpec:
        """What other trainer ranks need to push their own layers (see `weight_sync`) into the engines of this push
        (live and joining). `transport` ("shm" or "collective") overrides the configured one, e.g. to compare both
        on the same engines."""
        import ray

        return WeightSenderSpec(ray_address=ray.get_runtime_context().gcs_address,
                                ray_namespace=self.config.ray_namespace,
                                engine_names=tuple(self.engine_names[i] for i in self._push_targets()),
                                bucket_bytes=self.config.weight_sync_bucket_bytes,
                                transport=resolve_weight_transport(transport or self.weight_transport),
                                workers_per_engine=self.config.engines.tensor_model_parallel_size,
                                timeout_s=self.config.engines.weight_sync_timeout_s,
                                health_timeout_s=self.config.health_timeout_s)

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        """Open an in-place reload on every live engine and on the engines restarted since the last push (with no
        live engine left, it waits for them, at most `engine_start_timeout_s`). `in_flight`
        (types.IN_FLIGHT_POLICIES) says what happens to the requests still outstanding; with `none` there must be
        none. An engine lost here is left out of the push (no error: the next rollout finds out)."""
        if in_flight == "none" and self._outstanding():
            raise RuntimeError(f"{len(self._pending) + len(self._orphans)} rollout requests are outstanding; weights "
                               "can only change between rounds: drain completed() or call cancel_all() first")
        self._check_replacements(wait=not self._live_indices())
        self._watch.restart_clocks()
        self.actors.abandon(*self._pings.values())
        self._pings.clear()
        self._call_engines(self._push_targets(), "begin_weight_reload", in_flight)

    def finish_weight_sync(self, resume: bool = True) -> dict[str, list[dict]]:
        """Close the reload (layers that received no tensors keep their weights), clear the prefix cache, and count
        the push: tokens sampled from now on carry `weight_version`. Engines that do not answer a health check are
        given up first (one dropped from the push by a sender is hung or dead). Restarted engines that took this
        push serve requests from now on (`rejoined` names them). With `resume=False` the requests the push paused
        wait for `resume_generation` (the sync probe runs alone first). Returns each engine's reload report per
        worker (tensors received, parameters missing, names sent twice; see `weight_sync.reload_problem`), by
        engine name."""
        self.weight_version += 1
        self._check_at_once(self._push_targets())
        reports = self._call_engines(self._push_targets(), "finish_weight_reload", self.weight_version, resume)
        self.rejoined = tuple(sorted(i for i in self._joining if i in reports))
        for index in self.rejoined:
            self._joining.discard(index)
            self._alive[index] = True
            self._failures.pop(index, None)
            self._watch.forget(index)
            logger.info("rollout engine %d (%s) rejoined with weight version %d after its restart; %d of %d engines "
                        "serve requests (rollout/engines_alive)", index, self.engine_names[index],
                        self.weight_version, self.num_engines_alive(), len(self.engines))
        self._watch.restart_clocks()
        self.actors.abandon(*self._pings.values())
        self._pings.clear()
        return {f"engine {index}": worker_reports for index, worker_reports in reports.items()}

    def resume_generation(self) -> None:
        """Let the requests paused by a push finished with `resume=False` go on (`VLLMEngine.resume_generation`)."""
        self._call_engines(self._live_indices(), "resume_generation")

    def sync_probe(self, prompts: list[list[int]], max_tokens: int) -> list[RolloutGroup]:
        """Every live engine's greedy continuation of each prompt, with its log-probs (rollout/sync_check.py): one
        group per engine and prompt, `request_id` "engine <i>, prompt <j>". Outside the request book: `finished()`
        never returns these requests and `cancel_all()` never aborts them. An engine that fails and is unhealthy is
        given up and left out."""
        answers = self._call_engines(self._live_indices(), "sync_probe", prompts, max_tokens)
        return [RolloutGroup(request_id=f"engine {index}, prompt {j}", prompt_token_ids=list(prompt), samples=[sample],
                             engine_index=index)
                for index, samples in answers.items() for j, (prompt, sample) in enumerate(zip(prompts, samples))
                if sample is not None]

    def _call_engines(self, indices: list[int], method: str, *args) -> dict[int, object]:
        """Call `method(*args)` on engines `indices` at once; returns each answer by engine index. An engine that
        fails or takes longer than `weight_sync_timeout_s` and is unhealthy is given up (an error of a healthy one
        is raised)."""
        import ray

        refs = [getattr(self.engines[i], method).remote(*args) for i in indices]
        deadline = time.monotonic() + self.config.engines.weight_sync_timeout_s
        answers = {}
        for index, ref in zip(indices, refs):
            try:
                answers[index] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayError as err:
                if self._health_problem(index) is None:
                    raise
                self.actors.abandon(ref)
                self._mark_dead(index, err)
        return answers

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], transport: str | None = None,
                     in_flight: str = "none", resume: bool = True) -> dict[str, float]:
        """Load HF-named full tensors (all of them from this rank) into every engine; returns bytes, seconds,
        buckets and tensors. With several sending ranks use begin/finish_weight_sync and `WeightSender`.
        `transport` overrides the configured one (see `sender_spec`); `resume` as in `finish_weight_sync`.
        `RolloutEnginesLostError` when no engine took the push."""
        start = time.perf_counter()
        self.begin_weight_sync(in_flight)
        targets = self._push_targets()
        sender = WeightSender(self.sender_spec(transport), engine_handles=[self.engines[i] for i in targets])
        metrics = sender.send(named_tensors)
        self.finish_weight_sync(resume)
        if not self._live_indices():
            raise RolloutEnginesLostError(f"all {len(self.engines)} rollout engines are lost (last failure: "
                                          f"{self.last_engine_failure}); the weight push reached none")
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    # --- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every engine (restarted and given-up ones included) and, when this manager started Ray, Ray itself.
        Safe to call twice."""
        import ray

        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        actors = getattr(self, "actors", None)
        children = actors.stop(self._push_targets()) if actors is not None else []
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._pending.clear()
        self._orphans.clear()
        self._scoring.clear()
        self._score_orphans.clear()
        end_processes(children, self.config.health_timeout_s)
        if actors is not None:
            actors.remove_pid_dir()

    # --- internals: requests --------------------------------------------------------------------------------
    def _requests(self) -> list[EngineRequest]:
        return [*self._pending.values(), *self._orphans]

    def _outstanding(self) -> bool:
        return bool(self._pending or self._orphans)

    def _push_targets(self) -> list[int]:
        return sorted(set(self._live_indices()) | self._joining)

    def _dispatch(self, request: EngineRequest) -> None:
        live = self._live_indices()
        if not live:
            lost = sorted({request.request_id, *(r.request_id for r in self._requests())})
            coming = (f"; {self.num_engines_restarting()} restarted engine(s) take weights at the next push"
                      if self.num_engines_restarting() else "")
            raise RolloutEnginesLostError(
                f"all {len(self.engines)} rollout engines are lost (last failure: {self.last_engine_failure})"
                f"{coming}; {len(lost)} requests could not be served: {lost[:20]}{' ...' if len(lost) > 20 else ''}")
        load = {i: 0 for i in live}
        for pending in self._pending.values():
            if pending.engine_index in load:
                load[pending.engine_index] += 1
        request.engine_index = min(live, key=lambda i: (load[i], i))
        if load[request.engine_index] == 0:
            self._watch.given_work(request.engine_index)
        ref = self.engines[request.engine_index].generate.remote(request.request_id, request.prompt_token_ids,
                                                                 request.params)
        self._pending[ref] = request

    def _wait_one(self, timeout: float | None):
        """The ref of a finished request (not yet taken), looking after the engines' health every `TICK_S` while
        waiting; TimeoutError after `timeout` seconds."""
        import ray

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._look_after_engines()
            left = TICK_S if deadline is None else min(TICK_S, max(0.0, deadline - time.monotonic()))
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=left)
            if ready:
                return ready[0]
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"no rollout group finished within {timeout}s; {len(self._pending)} "
                                   "requests outstanding (raise the timeout or check health())")

    def _take(self, ref) -> RolloutGroup | None:
        """A finished request's group; None when it was cancelled or its engine failed (then it is sent again)."""
        import ray

        request = self._pending.pop(ref, None)
        if request is None:  # its engine was given up meanwhile: the request is sent again
            return None
        try:
            group = ray.get(ref)
        except ray.exceptions.RayError as err:
            if self._alive[request.engine_index] and self._health_problem(request.engine_index) is None:
                raise
            self._orphans.append(request)
            self._mark_dead(request.engine_index, err)
            return None
        self._watch.progressed(request.engine_index)
        return group

    # --- internals: health ----------------------------------------------------------------------------------
    def _look_after_engines(self) -> None:
        """One look while waiting: ping the live engines that are due, give up those whose ping failed or is
        overdue and those that stalled, admit or retry restarts, and send the given-up engines' requests again."""
        import ray

        now = time.monotonic()
        self._watch.look(now)
        for index in self._watch.pings_due(now, self._live_indices()):
            self._pings[index] = self.actors.ping(index)
            self._watch.ping_sent(index, now)
        if self._pings:
            answered, _ = ray.wait(list(self._pings.values()), num_returns=len(self._pings), timeout=0)
            for index, ref in list(self._pings.items()):
                if ref in answered:
                    del self._pings[index]
                    self._watch.ping_answered(index)
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as err:
                        self._mark_dead(index, f"failed its health check: {root_cause(err)}")
        for index in self._watch.unanswered(now):
            self._mark_dead(index, self.actors.hung_cause())
        busy = sorted({request.engine_index for request in self._pending.values()})
        for index in self._watch.stalled(busy, self._live_indices()):
            held = sum(request.engine_index == index for request in self._pending.values())
            self._mark_dead(index, f"finished none of its {held} requests for "
                                   f"actor_rollout_ref.rollout.engine_health.stall_timeout_s="
                                   f"{self.health_config.stall_timeout_s:g}s while other engines finished groups")
        self._check_replacements()
        self.actors.read_abandoned()
        send_queued(self._orphans, self._dispatch)

    def _check_at_once(self, indices: list[int]) -> None:
        """Health-check engines `indices` at once (at most `health_timeout_s`); give up those that fail."""
        for index, problem in self.actors.problems(indices).items():
            self._mark_dead(index, problem)

    def _health_problem(self, index: int) -> str | None:
        """None when engine `index` answers its health check in time, else why not (one line)."""
        return self.actors.problems([index]).get(index)

    def _mark_dead(self, index: int, err: BaseException | str) -> None:
        """Give up engine `index` (once): log it, end its actor and processes, keep its requests to send again,
        and start another engine in its place when the restart budget allows."""
        if not (self._alive[index] or index in self._joining):
            return
        self._alive[index] = False
        self._joining.discard(index)
        self.actors.abandon(self._pings.pop(index, None))
        self._watch.forget(index)
        for ref in [ref for ref, request in self._pending.items() if request.engine_index == index]:
            self._orphans.append(self._pending.pop(ref))
            self.actors.abandon(ref)
        self._orphan_scoring_of(index)
        name, cause = self.engine_names[index], err if isinstance(err, str) else root_cause(err)
        self.actors.retire(index)
        refusal = self.actors.restart(index)
        self._failures.pop(index, None)
        self._failures[index] = f"engine {index} ({name}): {cause}" + (f", not restarted: {refusal}"
                                                                       if refusal else "")
        logger.warning("rollout engine %d (%s) failed: %s; %d of %d engines left (rollout/engines_alive), its %d "
                       "requests go to them; %s", index, name, cause, self.num_engines_alive(), len(self.engines),
                       sum(r.engine_index == index for r in self._orphans),
                       f"not restarted: {refusal}" if refusal else
                       f"restarting it as {self.actors.replacements[index].name} (restart "
                       f"{self._restarts.per_engine[index]} of this engine, {self._restarts.total} of the run; it "
                       f"serves once {'it is up' if self.config.frozen_weights else 'the next push reached it'})")

    def _check_replacements(self, wait: bool = False) -> None:
        """Restarted engines that are up join the next push (a teacher's serve at once); a failed start is recorded
        as the last failure."""
        admitted, failures = self.actors.admit(wait)
        for index in admitted:
            self._watch.forget(index)
            if self.config.frozen_weights:  # a teacher's engine loads its own weights: it serves at once
                self._alive[index] = True
                self._failures.pop(index, None)
                logger.info("engine %d (%s) serves again after its restart", index, self.engine_names[index])
            else:
                self._joining.add(index)
        for index, failure in failures.items():
            self._failures.pop(index, None)
            self._failures[index] = failure
