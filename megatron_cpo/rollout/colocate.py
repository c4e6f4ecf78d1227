"""Colocated engines (`rollout.mode=colocate`): vLLM engines on the trainer's own devices, one phase at a time.

Rank 0 starts one `megatron-cpo rollout` server process per rollout tensor-parallel group of the trainer's ranks
(`world_size / rollout.tensor_model_parallel_size` engines), each in its own process tree, bound to loopback with a
fresh random token, and pinned to the devices of those ranks (`CUDA_VISIBLE_DEVICES`). Its manager is the
server-mode client (`ServerRolloutManager`) pointed at them, and weights reach them over shared memory (the
`/dev/shm` bucket transport: the servers are on the sending ranks' node), never over the network; no Ray.
Colocation is single-node: a trainer spanning several nodes is refused (its other nodes' devices would have no
engine). Between phases the engines sleep: when nothing is outstanding after a round of generation, vLLM's sleep
mode (level 1: KV cache freed, weights offloaded to host memory) gives the devices to training, and the next weight
push or prompt wakes them. On CPU vLLM has no sleep mode: that is said once in the log and the engines stay loaded.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from megatron_cpo import platform
from megatron_cpo.rollout.processes import end_processes
from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEngineStartError

logger = logging.getLogger(__name__)
_POLL_S = 0.2


def colocated_engine_count(world_size: int, local_world_size: int, rollout_tp: int) -> int:
    """Engines for a trainer of `world_size` ranks on one node: one per rollout-TP group of its ranks."""
    if world_size != local_world_size:
        raise ValueError(f"actor_rollout_ref.rollout.mode=colocate runs on one node, but the trainer has {world_size} "
                         f"ranks and {local_world_size} on this node; use mode=ray or mode=server across nodes")
    if world_size % rollout_tp:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} does not divide the "
                         f"trainer's {world_size} ranks; colocated engines take the devices of whole rollout-TP groups")
    return world_size // rollout_tp


def _device_list(first: int, count: int) -> str:
    """The devices of local ranks first..first+count-1, through the parent's CUDA_VISIBLE_DEVICES when it is set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(first + count)]
    return ",".join(devices[first:first + count])


class ColocatedRolloutManager(ServerRolloutManager):
    """Starts the colocated engine servers, talks to them as a server-mode client, and stops them at shutdown."""

    def __init__(self, config: EngineLaunchConfig, num_engines: int, timeout_s: float, min_model_len: int,
                 sleep_level: int = 1) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="colocated-rollout-"))
        self._processes: list[subprocess.Popen] = []
        self.sleep_level = sleep_level
        self._asleep = False
        token = secrets.token_hex(32)
        token_file = self._dir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        try:
            urls = self._start_servers(config, num_engines, token_file)
            super().__init__(ServerClientConfig(
                urls=tuple(urls), token=token, timeout_s=timeout_s,
                weight_transport="shm" if config.engines.weight_transport == "auto" else config.engines.weight_transport,
                weight_sync_bucket_bytes=config.weight_sync_bucket_bytes,
                weight_sync_timeout_s=config.engines.weight_sync_timeout_s, min_model_len=min_model_len))
        except BaseException:
            self._stop_servers(config.health_timeout_s)
            raise
        self._grace_s = config.health_timeout_s
        if not platform.has_cuda():
            logger.info("colocated rollout on CPU: vLLM sleep/wake does nothing here (no device memory to free); "
                        "the %d engine(s) stay loaded while the trainer trains", num_engines)

    def _start_servers(self, config: EngineLaunchConfig, num_engines: int, token_file: Path) -> list[str]:
        for index in range(num_engines):
            ready = self._dir / f"ready-{index}"
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(config.kv_cache_space_gib), **config.engine_env)
            if platform.has_cuda():
                env["CUDA_VISIBLE_DEVICES"] = _device_list(index * config.engines.tensor_model_parallel_size,
                                                           config.engines.tensor_model_parallel_size)
            for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
                env.pop(variable, None)  # the engine is not a member of the trainer's process group
            command = [sys.executable, "-m", "megatron_cpo.cli", "rollout", "--model", config.model_path,
                       "--tensor-parallel-size", str(config.engines.tensor_model_parallel_size), "--host", "127.0.0.1",
                       "--port", "0", "--token-file", str(token_file), "--dtype", config.dtype,
                       "--max-model-len", str(config.max_model_len),
                       "--gpu-memory-utilization", str(config.engines.gpu_memory_utilization),
                       "--kv-cache-gib", str(config.kv_cache_space_gib), "--seed", str(config.seed + index),
                       "--ready-file", str(ready), *(["--enable-sleep-mode"] if config.uses_gpu and config.enable_sleep_mode else [])]
            log = open(self._dir / f"engine-{index}.log", "wb")
            self._processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True))
            log.close()
        return [self._wait_ready(index, config.engine_start_timeout_s) for index in range(num_engines)]

    def _wait_ready(self, index: int, timeout_s: float) -> str:
        ready, process = self._dir / f"ready-{index}", self._processes[index]
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None:
                tail = (self._dir / f"engine-{index}.log").read_text(errors="replace").strip().splitlines()[-5:]
                raise RolloutEngineStartError(f"colocated rollout engine {index} exited with status "
                                              f"{process.returncode} while starting: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise RolloutEngineStartError(f"colocated rollout engine {index} did not start within "
                                              f"rollout engine_start_timeout_s={timeout_s}s (log: "
                                              f"{self._dir / f'engine-{index}.log'})")
            time.sleep(_POLL_S)
        return ready.read_text().strip()

    # --- sleep between phases (GPU) ---------------------------------------------------------------------------
    def _sleep_if_idle(self) -> None:
        if self.sleep_level and platform.has_cuda() and not self._pending and not self._asleep and self._live_indices():
            self.sleep(self.sleep_level)
            self._asleep = True

    def _wake(self) -> None:
        if self._asleep:
            self.wake_up()
            self._asleep = False

    def submit(self, request_id, prompt_token_ids, params) -> None:
        self._wake()
        super().submit(request_id, prompt_token_ids, params)

    def completed(self, timeout=None):
        yield from super().completed(timeout)
        self._sleep_if_idle()

    def finished(self, timeout=None):
        groups = super().finished(timeout)
        self._sleep_if_idle()
        return groups

    def begin_weight_sync(self) -> None:
        self._wake()
        super().begin_weight_sync()

    # --- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._stop_servers(getattr(self, "_grace_s", 30.0))

    def _stop_servers(self, grace_s: float) -> None:
        """SIGTERM each server (it stops its engines), then end whatever of its process tree is left."""
        processes = []
        for popen in self._processes:
            try:
                processes += [psutil.Process(popen.pid), *psutil.Process(popen.pid).children(recursive=True)]
            except psutil.Error:
                continue
        for popen in self._processes:
            if popen.poll() is None:
                popen.terminate()
        for popen in self._processes:
            try:
                popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        end_processes(processes, grace_s)
        self._processes = []
        shutil.rmtree(self._dir, ignore_errors=True)
