"""Colocated engines (`rollout.mode=colocate`): vLLM engines on the trainer's own devices, one phase at a time.

On every node the node's first trainer rank (LOCAL_RANK 0) starts one `megatron-cpo rollout` server process per
rollout tensor-parallel group of the node's ranks (`LOCAL_WORLD_SIZE / rollout.tensor_model_parallel_size` engines),
each in its own process tree and pinned to the devices of those ranks (`CUDA_VISIBLE_DEVICES`); every server takes
the one random token rank 0 drew for the run. Rank 0's manager is the server-mode client (`ServerRolloutManager`)
over all nodes' servers. On one node the servers bind to loopback and weights reach them over shared memory (the
`/dev/shm` bucket transport: the servers are on the sending ranks' node); across nodes each node's servers bind to
its address on the route to the trainer's master and weights go over the collective transport (gloo, NCCL on
GPUs), as in server mode. No Ray. Between phases the engines sleep: when nothing is outstanding after a round of
generation, vLLM's sleep mode (level 1: KV cache freed, weights offloaded to host memory) gives the devices to
training, and the next weight push or prompt wakes them. On CPU vLLM has no sleep mode: that is said once in the log
and the engines stay loaded.
"""
from __future__ import annotations

import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

from megatron_cpo import platform
from megatron_cpo.rollout.http_client import address_towards
from megatron_cpo.rollout.processes import end_processes
from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEngineStartError

logger = logging.getLogger(__name__)
_POLL_S = 0.2
LOOPBACK = "127.0.0.1"


def colocated_layout(world_size: int, local_world_size: int, rollout_tp: int) -> tuple[int, int]:
    """(nodes, engines per node) of a trainer of `world_size` ranks with `local_world_size` on each node: one engine
    per rollout-TP group of a node's ranks."""
    if local_world_size < 1 or world_size % local_world_size:
        raise ValueError(f"actor_rollout_ref.rollout.mode=colocate needs the same number of trainer ranks on every "
                         f"node, but {world_size} ranks do not make whole nodes of {local_world_size}; start every "
                         "node with the same --nproc-per-node")
    if local_world_size % rollout_tp:
        raise ValueError(f"actor_rollout_ref.rollout.tensor_model_parallel_size={rollout_tp} does not divide the "
                         f"{local_world_size} trainer ranks of a node; colocated engines take the devices of whole "
                         "rollout-TP groups of one node")
    return world_size // local_world_size, local_world_size // rollout_tp


def colocated_weight_transport(configured: str, nodes: int) -> str:
    """`rollout.weight_transport` for colocated engines: `auto` is shared memory on one node and the collective
    transport across nodes (a node's shared memory cannot reach another node's engines)."""
    if configured == "auto":
        return "shm" if nodes == 1 else "collective"
    if configured == "shm" and nodes > 1:
        raise ValueError(f"actor_rollout_ref.rollout.weight_transport=shm reaches only engines on the sending rank's "
                         f"node, but the colocated trainer spans {nodes} nodes; use auto or collective")
    return configured


def torchrun_world() -> tuple[int, int, int, int]:
    """(rank, local rank, world size, local world size) as torchrun sets them (one process: 0, 0, 1, 1)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0")), world_size,
            int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size))))


def _device_list(first: int, count: int) -> str:
    """The devices of local ranks first..first+count-1, through the parent's CUDA_VISIBLE_DEVICES when it is set."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(first + count)]
    return ",".join(devices[first:first + count])


class NodeEngineServers:
    """The colocated engine servers of one node: `count` `megatron-cpo rollout` processes, engine i on the devices
    of the node's rollout-TP group i, bound to `host`, taking `token`. Started (and ready) on construction; a
    failure stops what was started and raises `RolloutEngineStartError` naming the engine and its log."""

    def __init__(self, config: EngineLaunchConfig, count: int, token: str, host: str = LOOPBACK, node: int = 0
                 ) -> None:
        self.node = node
        self.processes: list[subprocess.Popen] = []
        self._dir = Path(tempfile.mkdtemp(prefix="colocated-rollout-"))  # private (0700): the token file lives here
        self._grace_s = config.health_timeout_s
        token_file = self._dir / "token"
        token_file.write_text(token)
        token_file.chmod(0o600)
        try:
            for index in range(count):
                self._start(config, index, count, token_file, host)
            self.urls = [self._wait_ready(index, config.engine_start_timeout_s) for index in range(count)]
        except BaseException:
            self.shutdown()
            raise
        logger.info("node %d: %d colocated engine server(s) at %s (pids %s)", node, count, ", ".join(self.urls),
                    ", ".join(str(process.pid) for process in self.processes))

    def _start(self, config: EngineLaunchConfig, index: int, count: int, token_file: Path, host: str) -> None:
        tp = config.engines.tensor_model_parallel_size
        kv_cache_gib = config.kv_cache_space_gib  # once: `auto` reads the free memory
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib), **config.engine_env)
        if platform.has_cuda():
            env["CUDA_VISIBLE_DEVICES"] = _device_list(index * tp, tp)
        for variable in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(variable, None)  # the engine is not a member of the trainer's process group
        command = [sys.executable, "-m", "megatron_cpo.cli", "rollout", "--model", config.model_path,
                   "--tensor-parallel-size", str(tp), "--host", host, "--port", "0", "--token-file", str(token_file),
                   "--dtype", config.dtype, "--max-model-len", str(config.max_model_len),
                   "--gpu-memory-utilization", str(config.engines.gpu_memory_utilization),
                   "--kv-cache-gib", str(kv_cache_gib),
                   "--seed", str(config.seed + self.node * count + index), "--ready-file",
                   str(self._dir / f"ready-{index}"),
                   *(["--enable-sleep-mode"] if config.uses_gpu and config.enable_sleep_mode else [])]
        with open(self._dir / f"engine-{index}.log", "wb") as log:
            self.processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def _wait_ready(self, index: int, timeout_s: float) -> str:
        ready, process, log = self._dir / f"ready-{index}", self.processes[index], self._dir / f"engine-{index}.log"
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if process.poll() is not None:
                tail = log.read_text(errors="replace").strip().splitlines()[-5:]
                raise RolloutEngineStartError(f"colocated rollout engine {index} of node {self.node} exited with "
                                              f"status {process.returncode} while starting: {' | '.join(tail)}")
            if time.monotonic() > deadline:
                raise RolloutEngineStartError(f"colocated rollout engine {index} of node {self.node} did not start "
                                              f"within rollout engine_start_timeout_s={timeout_s}s (log: {log})")
            time.sleep(_POLL_S)
        return ready.read_text().strip()

    def end(self, url: str) -> None:
        """End the server at `url` (one of `urls`) and every process it started; nothing when it is not this node's."""
        if url not in getattr(self, "urls", []):
            return
        popen = self.processes[self.urls.index(url)]
        try:
            tree = [psutil.Process(popen.pid), *psutil.Process(popen.pid).children(recursive=True)]
        except psutil.Error:
            return
        end_processes(tree, self._grace_s)
        popen.poll()

    def shutdown(self) -> None:
        """SIGTERM each server (it stops its engines), then end whatever of its process tree is left. Safe twice."""
        processes = []
        for popen in self.processes:
            try:
                processes += [psutil.Process(popen.pid), *psutil.Process(popen.pid).children(recursive=True)]
            except psutil.Error:
                continue
        for popen in self.processes:
            if popen.poll() is None:
                popen.terminate()
        for popen in self.processes:
            try:
                popen.wait(timeout=self._grace_s)
            except subprocess.TimeoutExpired:
                pass
        end_processes(processes, self._grace_s)
        self.processes = []
        shutil.rmtree(self._dir, ignore_errors=True)


def start_colocated_engines(config: EngineLaunchConfig, exchange: Callable[[Any], list], client: dict[str, Any]
                            ) -> tuple[ColocatedRolloutManager | None, NodeEngineServers | None]:
    """Every trainer rank calls this together; `exchange(value)` returns every rank's value in rank order. Each
    node's first rank starts the node's engine servers; rank 0 gets the manager over all nodes' servers (which also
    stops rank 0's own servers at shutdown). Returns (the manager on rank 0, else None; the servers this rank started
    and must shut down, else None). A node whose engines fail to start fails every rank with its message.
    `client`: `ColocatedRolloutManager`'s keyword arguments besides the URLs, token, transport and servers."""
    rank, local_rank, world_size, local_world_size = torchrun_world()
    nodes, per_node = colocated_layout(world_size, local_world_size, config.engines.tensor_model_parallel_size)
    transport = colocated_weight_transport(config.engines.weight_transport, nodes)
    token = exchange(secrets.token_hex(32) if rank == 0 else None)[0]
    host = LOOPBACK if nodes == 1 else address_towards(os.environ.get("MASTER_ADDR", LOOPBACK))
    servers, failure = None, None
    if local_rank == 0:
        node = rank // local_world_size  # torchrun numbers a node's ranks contiguously
        try:
            servers = NodeEngineServers(config, per_node, token, host, node)
        except Exception as err:  # every rank must hear of it, or the others would wait in the exchange
            failure = f"node {node} ({socket.gethostname()}): {err}"
    reports = exchange((servers.urls if servers is not None else [], failure))
    failures = [failure for _, failure in reports if failure]
    if failures:
        if servers is not None:
            servers.shutdown()
        raise RolloutEngineStartError("; ".join(failures))
    if rank != 0:
        return None, servers
    urls = [url for node_urls, _ in reports for url in node_urls]
    logger.info("colocated rollout on %d node(s): %d engine(s), weights by %s", nodes, len(urls), transport)
    return ColocatedRolloutManager(config, urls, token, transport, local_servers=servers, **client), None


class ColocatedRolloutManager(ServerRolloutManager):
    """The server-mode client over colocated engine servers; it sleeps them between phases and, at shutdown, stops
    the servers of its own node (`local_servers`)."""

    def __init__(self, config: EngineLaunchConfig, urls: list[str], token: str, weight_transport: str,
                 timeout_s: float, min_model_len: int, sleep_level: int = 1,
                 local_servers: NodeEngineServers | None = None) -> None:
        self.local_servers = local_servers
        self.sleep_level = sleep_level
        self._asleep = False
        try:
            super().__init__(ServerClientConfig(
                urls=tuple(urls), token=token, timeout_s=timeout_s, weight_transport=weight_transport,
                weight_sync_bucket_bytes=config.weight_sync_bucket_bytes,
                weight_sync_timeout_s=config.engines.weight_sync_timeout_s, min_model_len=min_model_len,
                health=config.engines.engine_health))
        except BaseException:
            if local_servers is not None:
                local_servers.shutdown()
            raise
        if not platform.has_cuda():
            logger.info("colocated rollout on CPU: vLLM sleep/wake does nothing here (no device memory to free); "
                        "the %d engine(s) stay loaded while the trainer trains", len(urls))

    @classmethod
    def start(cls, config: EngineLaunchConfig, num_engines: int, timeout_s: float, min_model_len: int,
              sleep_level: int = 1) -> ColocatedRolloutManager:
        """`num_engines` servers on this node (loopback, a fresh token) and the manager over them: one process's
        colocated rollout (a multi-node trainer uses `start_colocated_engines` on every rank)."""
        token = secrets.token_hex(32)
        servers = NodeEngineServers(config, num_engines, token)
        return cls(config, servers.urls, token, colocated_weight_transport(config.engines.weight_transport, 1),
                   timeout_s, min_model_len, sleep_level, local_servers=servers)

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

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        self._wake()
        super().begin_weight_sync(in_flight)

    def _mark_dead(self, index: int, cause: str) -> None:
        """A given-up server of this node is ended, so that a hung one does not keep its devices; it is not
        restarted (docs/launch.md, "Engines that hang or die")."""
        known = self._alive[index] or index in self._joining
        super()._mark_dead(index, cause)
        if known and self.local_servers is not None:
            self.local_servers.end(self.engines[index])

    # --- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self.local_servers is not None:
                self.local_servers.shutdown()
