"""The trainer's side of the rollout server's HTTP protocol: requests on a background event loop, and the weight push.

`HttpCaller` runs one aiohttp session on its own thread, so synchronous trainer code can keep hundreds of
generation long-polls in flight (`spawn`) and make short calls with a deadline (`call`). Errors are
`RolloutServerError`s that name the server's URL; a refused token is `RolloutServerAuthError`.

`ServerSenderSpec` / `HttpWeightSender` push weights into every server of a run, from any trainer rank (the spec is
picklable and broadcast from rank 0, like `WeightSenderSpec`): over shared memory (`/weights/load_shm`, servers on
the sending rank's node) or over a gloo/NCCL `WeightGroup` that the servers' engine workers join at this rank's
store (`/weights/join`), then one broadcast per bucket (`/weights/receive`). A group is opened on the first sync and
kept for the run (keyed by the spec, which carries the run's session id); `close_server_groups` closes it.
"""
from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import torch

from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.buckets import (
    bucket_layout,
    entries_to_wire,
    iter_buckets,
    pack_bucket,
    release_bucket,
    write_bucket,
)
from megatron_cpo.rollout.collective import WeightGroup, host_weight_store
from megatron_cpo.rollout.types import WeightPushInterruptedError

logger = logging.getLogger(__name__)


class RolloutServerError(RuntimeError):
    """A rollout server did not answer, could not be reached, or answered with an error; the message names it."""

    def __init__(self, url: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.url, self.status = url, status


class RolloutServerAuthError(RolloutServerError):
    """The server refused the token (HTTP 401)."""


class HttpCaller:
    """An aiohttp session on a private event-loop thread. `call` waits for the answer; `spawn` returns a future."""

    def __init__(self, token: str) -> None:
        self.headers = proto.authorization_header(token)
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="rollout-http", daemon=True)
        self._thread.start()
        self._session = asyncio.run_coroutine_threadsafe(self._open(), self.loop).result()

    async def _open(self):
        import aiohttp

        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=self.headers)

    def spawn(self, url: str, route: str, payload: dict | None, timeout_s: float | None,
              connect_timeout_s: float | None = None) -> concurrent.futures.Future:
        """Start a request; `timeout_s` bounds the whole exchange (None: a long poll), `connect_timeout_s` the
        connection alone."""
        return asyncio.run_coroutine_threadsafe(
            self._request(url, route, payload, timeout_s, connect_timeout_s), self.loop)

    def call(self, url: str, route: str, payload: dict | None, timeout_s: float) -> dict:
        return self.spawn(url, route, payload, timeout_s).result()

    async def _request(self, url: str, route: str, payload: dict | None, timeout_s: float | None,
                       connect_timeout_s: float | None) -> dict:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=connect_timeout_s or timeout_s)
        method = "GET" if payload is None else "POST"
        try:
            async with self._session.request(method, url + route, json=payload, timeout=timeout) as response:
                try:
                    body = await response.json(content_type=None)
                except ValueError:
                    body = {"error": (await response.text())[:200]}
        except asyncio.TimeoutError:
            raise RolloutServerError(url, f"rollout server {url} did not answer {route} within {timeout_s}s; check "
                                          "that it is running and serving (a stopped or overloaded process, or a "
                                          "port that is not a rollout server), or raise "
                                          "actor_rollout_ref.rollout.server_timeout_s") from None
        except aiohttp.ClientError as err:
            raise RolloutServerError(url, f"rollout server {url} could not be reached for {route}: "
                                          f"{type(err).__name__}: {err}") from err
        if response.status == 401:
            raise RolloutServerAuthError(url, f"rollout server {url} refused the token for {route}: "
                                              f"{body.get('error')}; give the token the server was started with "
                                              "(actor_rollout_ref.rollout.server_token_file)", 401)
        if response.status != 200 and not (route == proto.HEALTH and response.status == 503):
            raise RolloutServerError(url, f"rollout server {url} failed {route} (HTTP {response.status}): "
                                          f"{body.get('error', body)}", response.status)
        return body

    def close(self) -> None:
        if self.loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._session.close(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        self.loop.close()


def health_problem(caller: HttpCaller, url: str, timeout_s: float) -> tuple[str | None, dict]:
    """(None, health body) when the server at `url` answers healthy within `timeout_s`, else (why not, {})."""
    try:
        body = caller.call(url, proto.HEALTH, None, timeout_s)
    except RolloutServerError as err:
        return str(err), {}
    if not body.get("ok"):
        return f"rollout server {url} is unhealthy: {'; '.join(body.get('problems', [])) or body}", {}
    return None, body


def wait_all(futures: list[concurrent.futures.Future]) -> list[Any]:
    """Every future's result; the first error is raised after all of them finished (so none is left running)."""
    concurrent.futures.wait(futures)
    return [future.result() for future in futures]


@dataclass(frozen=True)
class ServerSenderSpec:
    """What a trainer rank needs to push weights into the servers; picklable, broadcast from rank 0."""

    urls: tuple[str, ...]
    token: str
    workers: tuple[int, ...]  # engine workers per server (engines x TP): its group ranks
    bucket_bytes: int
    transport: str  # "shm" or "collective"
    timeout_s: float
    session: str  # the run's id, so a new run never reuses an old run's group
    health_timeout_s: float = 30.0  # how long a server that failed a load may take to answer /health

    def make_sender(self) -> HttpWeightSender:
        return HttpWeightSender(self)


class HttpWeightSender:
    """Streams one rank's HF-named tensors into every server, bucket by bucket (see the module docstring). Over
    shared memory a server that does not load a bucket within `timeout_s`, or fails and is unhealthy, is dropped from
    the rest of this push (`dropped`), as `weight_sync.WeightSender` drops a Ray engine."""

    def __init__(self, spec: ServerSenderSpec) -> None:
        self.spec = spec
        self._caller = _callers.get(spec.token)
        self._urls = list(spec.urls)  # those still in this push
        self.dropped: dict[str, str] = {}

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, float]:
        start = time.perf_counter()
        group_init_s = 0.0
        group = None
        if self.spec.transport == "collective":
            group = _groups.get(self.spec)
            if group is None:
                group = _groups.open(self.spec, self._caller)
                group_init_s = time.perf_counter() - start
        num_bytes = num_buckets = num_tensors = 0
        buffer = torch.empty(0, dtype=torch.uint8)
        for bucket in iter_buckets(named_tensors, self.spec.bucket_bytes):
            if group is None:
                self._load_shm(bucket)
            else:
                entries, nbytes = bucket_layout(bucket)
                if buffer.numel() < nbytes or buffer.device != group.device:
                    buffer = torch.empty(max(nbytes, self.spec.bucket_bytes), dtype=torch.uint8, device=group.device)
                pack_bucket(buffer[:nbytes], entries, bucket)
                self._broadcast(group, buffer[:nbytes], entries_to_wire(entries), nbytes, num_buckets)
            num_bytes += sum(t.numel() * t.element_size() for _, t in bucket)
            num_buckets += 1
            num_tensors += len(bucket)
        metrics = {"bytes": float(num_bytes), "seconds": time.perf_counter() - start, "buckets": float(num_buckets),
                   "tensors": float(num_tensors), "engines_dropped": float(len(self.dropped))}
        if group is not None:
            metrics["group_init_seconds"] = group_init_s
        return metrics

    def _load_shm(self, bucket: list) -> None:
        spec = write_bucket(bucket, prefix="megatron_cpo-weights")
        try:
            loads = {url: self._caller.spawn(url, proto.WEIGHTS_LOAD_SHM, {"bucket": spec.to_wire()},
                                             self.spec.timeout_s) for url in self._urls}
            concurrent.futures.wait(loads.values())
            for url, load in loads.items():
                err = load.exception()
                if err is None:
                    continue
                if isinstance(err, RolloutServerAuthError) or health_problem(
                        self._caller, url, self.spec.health_timeout_s)[0] is None:
                    raise err
                self._urls.remove(url)
                self.dropped[url] = str(err)
                logger.warning("rollout server %s left this weight push (%d servers complete it): %s", url,
                               len(self._urls), err)
        finally:
            release_bucket(spec)

    def _broadcast(self, group: WeightGroup, buffer: torch.Tensor, entries: list, nbytes: int, index: int) -> None:
        payload = {"name": group.name, "entries": entries, "nbytes": nbytes}
        loads = [self._caller.spawn(url, proto.WEIGHTS_RECEIVE, payload, self.spec.timeout_s) for url in self.spec.urls]
        try:
            group.broadcast(buffer)
            wait_all(loads)
        except BaseException as err:
            _groups.close(self.spec)
            raise WeightPushInterruptedError(
                f"weight-sync broadcast of bucket {index} over group {group.name!r} ({group.address}) failed: {err}; "
                "the group is closed and the next sync opens a new one") from err


class _Callers:
    """One `HttpCaller` per token in this process (a sending rank's sessions outlive a single sync)."""

    def __init__(self) -> None:
        self._callers: dict[str, HttpCaller] = {}
        atexit.register(self.close_all)  # registered before `_groups`' hook, so it runs after the groups closed

    def close_all(self) -> None:
        for caller in self._callers.values():
            caller.close()
        self._callers.clear()

    def get(self, token: str) -> HttpCaller:
        if token not in self._callers:
            self._callers[token] = HttpCaller(token)
        return self._callers[token]


class _ServerGroups:
    """This rank's open weight-sync groups, one per spec."""

    def __init__(self) -> None:
        self._groups: dict[ServerSenderSpec, WeightGroup] = {}
        atexit.register(self.close_all)

    def get(self, spec: ServerSenderSpec) -> WeightGroup | None:
        return self._groups.get(spec)

    def open(self, spec: ServerSenderSpec, caller: HttpCaller) -> WeightGroup:
        """Host a store on this rank, have every server join it, join as rank 0. A previous group of this spec's
        run opened by this rank (before a server died) is closed first."""
        for old in [key for key in self._groups if key.session == spec.session]:
            self.close(old)
        host = _address_towards(spec.urls[0])
        store = host_weight_store(host, spec.timeout_s)
        name = f"weights-{uuid.uuid4().hex[:8]}"
        world_size = 1 + sum(spec.workers)
        firsts = [1 + sum(spec.workers[:i]) for i in range(len(spec.urls))]
        joins = [caller.spawn(url, proto.WEIGHTS_JOIN, {"name": name, "host": host, "port": store.port,
                                                         "first_rank": first, "world_size": world_size,
                                                         "timeout_s": spec.timeout_s, "session": spec.session},
                              spec.timeout_s + 30)
                 for url, first in zip(spec.urls, firsts)]

        def failed_join() -> str | None:
            for url, join in zip(spec.urls, joins):
                if join.done() and join.exception() is not None:
                    return f"{url} failed to join: {join.exception()}"
            return None

        try:
            group = WeightGroup(store, name, f"{host}:{store.port}", 0, world_size, spec.timeout_s, failed_join)
        except BaseException:
            concurrent.futures.wait(joins, timeout=spec.timeout_s)
            raise
        wait_all(joins)
        self._groups[spec] = group
        return group

    def close(self, spec: ServerSenderSpec) -> None:
        group = self._groups.pop(spec, None)
        if group is None:
            return
        caller = _callers.get(spec.token)
        leaves = [caller.spawn(url, proto.WEIGHTS_LEAVE, {"name": group.name}, 30) for url in spec.urls]
        concurrent.futures.wait(leaves, timeout=30)
        group.close()

    def close_all(self, session: str | None = None) -> None:
        for spec in [key for key in self._groups if session is None or key.session == session]:
            try:
                self.close(spec)
            except Exception:  # noqa: BLE001 - best effort at exit: a server may be gone
                pass


_callers = _Callers()
_groups = _ServerGroups()


def close_server_groups(session: str) -> None:
    """Close this process's weight-sync groups of run `session` (the servers leave them too)."""
    _groups.close_all(session)


def address_towards(host: str) -> str:
    """This machine's address on the route to `host` (loopback for a loopback host); nothing is sent."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), 9))
        return probe.getsockname()[0]


def _address_towards(url: str) -> str:
    """This machine's address on the route to `url`'s host (loopback for a loopback server)."""
    return address_towards(urlsplit(url).hostname or "127.0.0.1")
