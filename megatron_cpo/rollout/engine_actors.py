"""The Ray actors behind a `RolloutManager`'s engine slots: started, ended together with every process they started,
and replaced within the restart budget. The manager (manager.py) decides when; this module does the Ray and process
work.

Each actor writes `<host> <pid>` to `<pid_dir>/<its name>.pid` as its first act (processes.py), so the engine core
and workers it starts can be found and ended even when the actor is killed or hangs. A replacement is a new actor
with its own name (`<prefix>-<slot>-restart<k>`), started in the background; `admit` reports it once it is up.
"""
from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from megatron_cpo.rollout.engine import VLLMEngine
from megatron_cpo.rollout.health import RestartBudget
from megatron_cpo.rollout.processes import end_processes, engine_processes
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEngineStartError
from megatron_cpo.rollout.weight_sync import close_weight_groups

logger = logging.getLogger(__name__)


@dataclass
class _Replacement:
    """An engine starting in the place of a given-up one."""
    handle: Any
    name: str
    ready: Any  # the ObjectRef of its `ready()`
    started: float  # time.monotonic()


class EngineActors:
    """`handles[i]` / `names[i]`: the actor serving slot i now (a given-up one stays until a replacement is up);
    `replacements`: the slots whose replacement is starting."""

    def __init__(self, config: EngineLaunchConfig, budget: RestartBudget) -> None:
        self.config = config
        self.budget = budget
        self.prefix = f"rollout-engine-{uuid.uuid4().hex[:8]}"
        self.names = tuple(f"{self.prefix}-{i}" for i in range(config.engines.num_engines))
        self.handles: list = []
        self.ready = [False] * config.engines.num_engines
        self.pid_dir = Path(tempfile.mkdtemp(prefix="rollout-engine-pids-"))
        self.replacements: dict[int, _Replacement] = {}
        self._retired: list = []  # actors given up (killed; `stop` kills them again, harmlessly)
        self._abandoned: list = []  # calls whose answer nobody waits for: read once they end (Ray logs unread errors)

    def _spawn(self, index: int, name: str):
        import ray

        config = self.config
        resources = ({"num_gpus": config.engines.tensor_model_parallel_size, "num_cpus": 1} if config.uses_gpu
                     else {"num_cpus": config.cpus_per_engine})
        env = {"VLLM_CPU_KVCACHE_SPACE": str(config.kv_cache_space_gib), **config.engine_env}
        return ray.remote(VLLMEngine).options(name=name, namespace=config.ray_namespace, max_concurrency=10_000,
                                              runtime_env={"env_vars": env}, **resources).remote(
            config, index, str(self.pid_dir / f"{name}.pid"))

    def start_all(self) -> None:
        """Start every slot's engine and wait until each is up; `RolloutEngineStartError` names the first that is
        not."""
        import ray

        self.handles = [self._spawn(index, name) for index, name in enumerate(self.names)]
        readiness = [engine.ready.remote() for engine in self.handles]
        for index, ref in enumerate(readiness):
            try:
                ray.get(ref, timeout=self.config.engine_start_timeout_s)
                self.ready[index] = True
            except ray.exceptions.GetTimeoutError:
                raise RolloutEngineStartError(
                    f"rollout engine {index} ({self.config.model_path}) did not start within "
                    f"rollout.engine_start_timeout_s={self.config.engine_start_timeout_s}s; check that Ray has "
                    "free resources for it or raise the timeout") from None
            except ray.exceptions.RayError as err:
                raise RolloutEngineStartError(
                    f"rollout engine {index} failed to start for model {self.config.model_path!r}: "
                    f"{root_cause(err)}") from err

    # --- health ---------------------------------------------------------------------------------------------
    def hung_cause(self) -> str:
        return (f"did not answer a health check within actor_rollout_ref.rollout.engine_health.timeout_s="
                f"{self.config.health_timeout_s:g}s (hung: a stopped or deadlocked engine process, or a device that "
                "stopped answering)")

    def ping(self, index: int):
        """Start slot `index`'s health check (`VLLMEngine.is_healthy`: a round trip through its processes)."""
        return self.handles[index].is_healthy.remote()

    def problems(self, indices: list[int]) -> dict[int, str]:
        """Health-check slots `indices` at once (at most `health_timeout_s`); why each that failed did."""
        import ray

        refs = {index: self.ping(index) for index in indices}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=self.config.health_timeout_s)
        found = {}
        for index, ref in refs.items():
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.GetTimeoutError:
                self.abandon(ref)
                found[index] = self.hung_cause()
            except ray.exceptions.RayError as err:
                found[index] = f"failed its health check: {root_cause(err)}"
        return found

    def abandon(self, *refs) -> None:
        """Calls nobody waits for any more (to engines given up, pings of a finished watch)."""
        self._abandoned += [ref for ref in refs if ref is not None]

    def read_abandoned(self, timeout: float = 0) -> None:
        """Read the abandoned calls that have ended (their errors are expected), so that Ray does not report them as
        unhandled errors, with tracebacks, when they are dropped."""
        import ray

        if not self._abandoned:
            return
        done, self._abandoned = ray.wait(self._abandoned, num_returns=len(self._abandoned), timeout=timeout)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                pass

    # --- lifecycle ------------------------------------------------------------------------------------------
    def retire(self, index: int) -> None:
        """End slot `index`'s actor and the processes it started, and close the weight groups reaching it."""
        self._end(self.handles[index], self.names[index])

    def _end(self, handle, name: str) -> None:
        import ray

        children = engine_processes(self.pid_dir, f"{name}.pid")  # before the kill, which would orphan them
        ray.kill(handle)
        self._retired.append(handle)
        end_processes(children, self.config.health_timeout_s)
        (self.pid_dir / f"{name}.pid").unlink(missing_ok=True)
        close_weight_groups([name])

    def restart(self, index: int) -> str | None:
        """Start a new engine for slot `index` in the background when the budget allows; None, or why not (a clause
        naming the setting)."""
        refusal = self.budget.refusal(index)
        if refusal is None:
            name = f"{self.prefix}-{index}-restart{self.budget.spend(index)}"
            handle = self._spawn(index, name)
            replacement = _Replacement(handle, name, handle.ready.remote(), time.monotonic())
            # said as soon as it is up, whatever the manager is doing (`admit` takes it in at its next look)
            replacement.ready.future().add_done_callback(functools.partial(_say_up, index, replacement))
            self.replacements[index] = replacement
        return refusal

    def admit(self, wait: bool = False) -> tuple[list[int], dict[int, str]]:
        """Slots whose replacement is up (now `handles` / `names` hold it), and the failed starts by slot (each
        described, logged, its actor ended and, within the budget, started again). `wait`: block until one is up or
        none is coming (at most `engine_start_timeout_s` per start)."""
        import ray

        admitted: list[int] = []
        failures: dict[int, str] = {}
        while self.replacements:
            refs = {replacement.ready: index for index, replacement in self.replacements.items()}
            oldest = min(replacement.started for replacement in self.replacements.values())
            timeout = max(0.0, oldest + self.config.engine_start_timeout_s - time.monotonic()) if wait else 0
            done, _ = ray.wait(list(refs), num_returns=1 if wait else len(refs), timeout=timeout)
            for ref, index in refs.items():
                replacement = self.replacements[index]
                failure = None
                if ref in done:
                    try:
                        ray.get(ref)
                    except ray.exceptions.RayError as err:
                        failure = root_cause(err)
                elif time.monotonic() - replacement.started > self.config.engine_start_timeout_s:
                    failure = (f"did not start within actor_rollout_ref.rollout.engine_start_timeout_s="
                               f"{self.config.engine_start_timeout_s:g}s")
                else:
                    continue
                del self.replacements[index]
                if failure is None:
                    self.handles[index] = replacement.handle
                    self.names = (*self.names[:index], replacement.name, *self.names[index + 1:])
                    self.ready[index] = True
                    admitted.append(index)
                    continue
                self._end(replacement.handle, replacement.name)
                refusal = self.restart(index)
                failures[index] = (f"engine {index} ({replacement.name}, restarted): {failure}"
                                   + (f", not restarted: {refusal}" if refusal else ""))
                logger.warning("the engine restarted in slot %d (%s) failed to start: %s; %s", index, replacement.name,
                               failure, f"not restarted: {refusal}" if refusal else "starting another")
            if not wait or admitted:
                break
        return admitted, failures

    def stop(self, serving: list[int]) -> list[psutil.Process]:
        """Stop the engines of `serving` cleanly, kill every actor (replacements and given-up ones included) and
        return the processes they started on this host, for the caller to end once Ray is down."""
        import ray

        children = engine_processes(self.pid_dir)
        if ray.is_initialized():
            close_weight_groups(self.names)
            stops = [self.handles[index].shutdown.remote() for index in serving if self.ready[index]]
            ray.wait(stops, num_returns=len(stops), timeout=self.config.health_timeout_s)
            for engine in [*self.handles, *(r.handle for r in self.replacements.values()), *self._retired]:
                ray.kill(engine)
            self.read_abandoned(timeout=min(5.0, self.config.health_timeout_s))
        return children

    def remove_pid_dir(self) -> None:
        shutil.rmtree(self.pid_dir, ignore_errors=True)


def _say_up(index: int, replacement: _Replacement, ready) -> None:
    """Log that a restarted engine is up (called by Ray's thread when its `ready()` returns; a failed start is
    reported by `EngineActors.admit`)."""
    if not ready.cancelled() and ready.exception() is None:
        logger.info("rollout engine %d restarted as %s is up after %.0f s; it takes the next weight push, then "
                    "requests", index, replacement.name, time.monotonic() - replacement.started)


def root_cause(err: BaseException) -> str:
    """The innermost error of a Ray failure (the actor's own exception and its detail lines, not Ray's wrapper)."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    for index in range(len(lines) - 1, -1, -1):
        if "Error" in lines[index] or "Exception" in lines[index]:
            return " | ".join(lines[index:index + 4])
    return lines[-1] if lines else type(err).__name__
