"""`RolloutManager`'s interface over rollout servers reached by HTTP (`rollout.mode=server`; also `colocate`).

Each server (`megatron-cpo rollout`, see `server.py`) counts as one engine of the manager: `engines` are the
servers' URLs, `engine_index` of a group is the server's position in `rollout.server_urls`. A prompt goes to the
least-loaded live server as one long-poll request. While it waits the manager pings each live server's `/health`
(which round-trips through its engines) every `engine_health.check_interval_s`; a server whose request fails while
its health check does too, whose ping is not answered within `engine_health.timeout_s`, or that stalls (health.py),
is given up (logged once; server_health.py) and the prompts it held are sent to the others, exactly as `RolloutManager`
does for an engine; with none left, `RolloutEnginesLostError` names the URLs and the prompts. The trainer does not
restart servers (it did not start them): a given-up server keeps being pinged, and once it answers healthy again
(restarted by whoever runs it) it is taken back at the next weight push, which it takes before it gets requests
(`rejoined`; `engine_restarts` counts them). Ray is never started. Every server must answer `/health` within
`server_timeout_s` when the manager is built, so a wrong URL or a port that never answers is one clear error naming
it.
"""
from __future__ import annotations

import concurrent.futures
import logging
import queue
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.config import EngineHealthConfig
from megatron_cpo.rollout.dispatch import TICK_S, EngineRequest, RequestBook
from megatron_cpo.rollout.health import EngineWatch
from megatron_cpo.rollout.http_client import (
    HttpCaller,
    HttpWeightSender,
    RolloutServerAuthError,
    RolloutServerError,
    ServerSenderSpec,
    close_server_groups,
    health_problem,
    wait_all,
)
from megatron_cpo.rollout.scoring import ScoreRequest
from megatron_cpo.rollout.server_health import ServerHealthBook
from megatron_cpo.rollout.server_scoring import ServerScoreBook
from megatron_cpo.rollout.types import RolloutEnginesLostError, RolloutEngineStartError, RolloutGroup

logger = logging.getLogger(__name__)


@dataclass
class ServerClientConfig:
    """Where the servers are and how to talk to them; the weight-sync settings of `RolloutConfig`."""

    urls: tuple[str, ...]
    token: str
    timeout_s: float = 30.0  # health checks and short calls; also the connect timeout of generation requests
    weight_transport: str = "collective"  # "shm" (servers on the sending ranks' node) or "collective"
    weight_sync_bucket_bytes: int = 256 * 1024**2
    weight_sync_timeout_s: float = 300.0
    min_model_len: int = 0  # the longest prompt + response the run needs; a server with less is refused
    health: EngineHealthConfig = field(default_factory=EngineHealthConfig)  # pings and stalls (restart: unused)
    frozen_weights: bool = False  # a teacher's servers: never pushed to, so one healthy again serves at once

    def __post_init__(self) -> None:
        if not self.urls:
            raise ValueError("actor_rollout_ref.rollout.server_urls is empty; give the URL of at least one "
                             "`megatron-cpo rollout` server, e.g. [http://127.0.0.1:8470]")
        bad = [url for url in self.urls if not url.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"actor_rollout_ref.rollout.server_urls holds {bad[0]!r}; write each as "
                             "http://HOST:PORT")
        if self.weight_transport not in ("shm", "collective"):
            raise ValueError(f"rollout weight_transport={self.weight_transport!r} for servers; use shm or collective")
        self.urls = tuple(url.rstrip("/") for url in self.urls)


class ServerRolloutManager(RequestBook, ServerHealthBook, ServerScoreBook):
    """Rollout servers behind `RolloutManager`'s submit / completed / weight-sync interface."""

    def __init__(self, config: ServerClientConfig) -> None:
        self.config = config
        self.engines = list(config.urls)
        self.engine_names = tuple(config.urls)
        self.weight_transport = config.weight_transport
        self._failures: dict[int, str] = {}  # why each given-up engine slot was (cleared when it serves again)
        self.weight_version = 0  # weight pushes completed (finish_weight_sync)
        self._session = uuid.uuid4().hex
        self._caller = HttpCaller(config.token)
        self._alive = [True] * len(self.engines)
        self._pending: dict[str, tuple[EngineRequest, concurrent.futures.Future]] = {}
        self._orphans: list[EngineRequest] = []  # requests of given-up servers, sent again at the next look
        self._scoring: dict[str, tuple[ScoreRequest, int, concurrent.futures.Future]] = {}  # a teacher's requests
        self._score_orphans: list[ScoreRequest] = []  # scoring requests of given-up servers (server_scoring.py)
        self._done: queue.Queue = queue.Queue()
        self._closed = False
        self._watch = EngineWatch(config.health, len(self.engines))
        self._pings: dict[int, concurrent.futures.Future] = {}  # server -> its /health call in flight
        self._recovered: set[int] = set()  # given-up servers that answered healthy since
        self._joining: set[int] = set()  # taken back: they take the next push before they get requests
        self.rejoined: tuple[int, ...] = ()
        self.engine_restarts = 0  # given-up servers taken back
        try:
            self._workers = self._check_servers()
        except BaseException:
            self._caller.close()
            raise

    def _check_servers(self) -> list[int]:
        """Every server answers /health in time and is healthy, serves long enough sequences and takes our token."""
        workers = []
        for url in self.engines:
            problem, body = health_problem(self._caller, url, self.config.timeout_s)
            if problem is not None:
                raise RolloutEngineStartError(problem)
            if body.get("max_model_len", 0) < self.config.min_model_len:
                raise RolloutEngineStartError(
                    f"rollout server {url} serves at most {body.get('max_model_len')} tokens per sequence but this "
                    f"run needs data.max_prompt_length + data.max_response_length = {self.config.min_model_len}; "
                    "restart it with a larger --max-model-len")
            self._caller.call(url, proto.CHECK_TOKEN, {}, self.config.timeout_s)  # 401 for a wrong token
            workers.append(int(body["engines"]) * int(body["workers_per_engine"]))
        return workers

    # --- generation -----------------------------------------------------------------------------------------
    def finished(self, timeout: float | None = None) -> list[RolloutGroup]:
        """Wait for one group, then return it with every other group already finished; [] when none outstanding."""
        while self._outstanding():
            keys = [self._wait_one(timeout)]
            while True:
                try:
                    keys.append(self._done.get_nowait())
                except queue.Empty:
                    break
            groups = [group for group in map(self._take, keys) if group is not None]
            if groups:
                return groups
        return []

    def cancel_all(self) -> int:
        """Abort everything outstanding on every live server; returns how many groups were dropped."""
        dropped = [future for _, future in self._pending.values()]
        count = len(dropped) + len(self._orphans)
        self._pending.clear()
        self._orphans.clear()
        cancels = [self._caller.spawn(url, proto.CANCEL, {}, self.config.timeout_s) for url in self._live_urls()]
        concurrent.futures.wait(cancels + dropped, timeout=self.config.timeout_s)
        return count

    # --- weights --------------------------------------------------------------------------------------------
    def sender_spec(self, transport: str | None = None) -> ServerSenderSpec:
        targets = self._push_targets()
        return ServerSenderSpec(urls=tuple(self.engines[i] for i in targets), token=self.config.token,
                                workers=tuple(self._workers[i] for i in targets),
                                bucket_bytes=self.config.weight_sync_bucket_bytes,
                                transport=transport or self.weight_transport,
                                timeout_s=self.config.weight_sync_timeout_s, session=self._session,
                                health_timeout_s=self.config.health.timeout_s)

    def begin_weight_sync(self, in_flight: str = "none") -> None:
        """Open an in-place reload on every live server and on given-up servers that answer healthy again (their
        old requests are cancelled first); `in_flight` as `RolloutManager.begin_weight_sync`. A server lost here is
        left out of the push."""
        if in_flight == "none" and self._outstanding():
            raise RuntimeError(f"{len(self._pending) + len(self._orphans)} rollout requests are outstanding; weights "
                               "can only change between rounds: drain completed() or call cancel_all() first")
        self._take_back_recovered()
        self._restart_clocks()
        self._call_servers(self._push_targets(), proto.WEIGHTS_BEGIN, {"in_flight": in_flight})

    def finish_weight_sync(self, resume: bool = True) -> dict[str, list[dict]]:
        """Close the reload on every server of the push and count it (`weight_version` labels the tokens sampled
        from now on); servers that do not answer /health are given up first, servers taken back serve requests from
        now on (`rejoined`); `resume` as `RolloutManager.finish_weight_sync`. Each engine's reload report per worker,
        by "<url> engine <j>"."""
        self.weight_version += 1
        self._check_at_once(self._push_targets())
        answers = self._call_servers(self._push_targets(), proto.WEIGHTS_FINISH,
                                     {"version": self.weight_version, "resume": resume})
        self.rejoined = tuple(sorted(i for i in self._joining if i in answers))
        for index in self.rejoined:
            self._joining.discard(index)
            self._alive[index] = True
            self._failures.pop(index, None)
            self.engine_restarts += 1
            logger.info("rollout server %d (%s) is back with weight version %d; %d of %d servers serve requests "
                           "(rollout/engines_alive)", index, self.engines[index], self.weight_version,
                           self.num_engines_alive(), len(self.engines))
        self._restart_clocks()
        return {f"{self.engines[index]} engine {j}": reports for index, body in answers.items()
                for j, reports in enumerate(body.get("reports", []))}

    def resume_generation(self) -> None:
        """Let the requests paused by a push finished with `resume=False` go on, on every live server."""
        self._call_servers(self._live_indices(), proto.WEIGHTS_RESUME, {})

    def sync_probe(self, prompts: list[list[int]], max_tokens: int) -> list[RolloutGroup]:
        """Every live server's engines' greedy continuations of each prompt, with their log-probs (`RolloutManager.
        sync_probe`; `request_id` "<url> engine <j>, prompt <k>"). Not outstanding requests: `finished()` never returns
        them and `cancel_all()` never aborts them."""
        answers = self._call_servers(self._live_indices(), proto.SYNC_PROBE,
                                     {"prompts": prompts, "max_tokens": max_tokens})
        return [RolloutGroup(request_id=f"{self.engines[index]} engine {j}, prompt {k}", prompt_token_ids=list(prompt),
                             samples=[proto.sample_from_wire(sample)], engine_index=index)
                for index, body in answers.items() for j, samples in enumerate(body["engines"])
                for k, (prompt, sample) in enumerate(zip(prompts, samples)) if sample is not None]

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], transport: str | None = None,
                     in_flight: str = "none", resume: bool = True) -> dict[str, float]:
        """Load HF-named full tensors (all of them from this rank) into every live server (`resume` as in
        `finish_weight_sync`)."""
        start = time.perf_counter()
        self.begin_weight_sync(in_flight)
        metrics = HttpWeightSender(self.sender_spec(transport)).send(named_tensors)
        self.finish_weight_sync(resume)
        if not self._live_indices():
            raise RolloutEnginesLostError(self._lost_message("the weight push reached none"))
        metrics["seconds"] = time.perf_counter() - start
        return metrics

    def sleep(self, level: int = 1) -> None:
        """vLLM sleep mode on every live server (free KV cache; level 1 offloads, 2 discards the weights)."""
        wait_all([self._caller.spawn(url, proto.SLEEP, {"level": level}, self.config.weight_sync_timeout_s)
                  for url in self._live_urls()])

    def wake_up(self) -> None:
        wait_all([self._caller.spawn(url, proto.WAKE_UP, {}, self.config.weight_sync_timeout_s)
                  for url in self._live_urls()])

    def _call_servers(self, indices: list[int], route: str, payload: dict | None = None) -> dict[int, dict]:
        """Call `route` with `payload` on servers `indices` at once; returns each answer by server index. One that
        fails and is unhealthy is given up (an error of a healthy one is raised)."""
        calls = [self._caller.spawn(self.engines[i], route, payload or {}, self.config.weight_sync_timeout_s)
                 for i in indices]
        concurrent.futures.wait(calls)
        answers = {}
        for index, call in zip(indices, calls):
            err = call.exception()
            if err is None:
                answers[index] = call.result()
                continue
            if isinstance(err, RolloutServerAuthError) or self._health_problem(index) is None:
                raise err
            self._mark_dead(index, str(err))
        return answers

    # --- lifecycle ------------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Drop what is outstanding and close this run's weight groups; the servers keep running. Safe twice."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._pending and self._live_indices():
                self.cancel_all()
            close_server_groups(self._session)
        finally:
            self._pending.clear()
            self._scoring.clear()
            self._score_orphans.clear()
            self._caller.close()

    # --- internals ------------------------------------------------------------------------------------------
    def _requests(self) -> list[EngineRequest]:
        return [*(request for request, _ in self._pending.values()), *self._orphans]

    def _outstanding(self) -> bool:
        return bool(self._pending or self._orphans)

    def _push_targets(self) -> list[int]:
        return sorted(set(self._live_indices()) | self._joining)

    def _live_urls(self) -> list[str]:
        return [self.engines[i] for i in self._live_indices()]

    def _lost_message(self, consequence: str) -> str:
        return (f"all {len(self.engines)} rollout servers are dead ({', '.join(self.engines)}; last failure: "
                f"{self.last_engine_failure}); {consequence}. Restart them (megatron-cpo rollout) and resume the run")

    def _dispatch(self, request: EngineRequest) -> None:
        live = self._live_indices()
        if not live:
            lost = sorted({request.request_id, *(r.request_id for r in self._requests())})
            raise RolloutEnginesLostError(self._lost_message(
                f"{len(lost)} requests could not be served: {lost[:20]}{' ...' if len(lost) > 20 else ''}"))
        load = {i: 0 for i in live}
        for pending, _ in self._pending.values():
            if pending.engine_index in load:
                load[pending.engine_index] += 1
        request.engine_index = min(live, key=lambda i: (load[i], i))
        if load[request.engine_index] == 0:
            self._watch.given_work(request.engine_index)
        payload = {"request_id": request.request_id, "prompt_token_ids": request.prompt_token_ids,
                   "params": proto.params_to_wire(request.params)}
        key = uuid.uuid4().hex
        future = self._caller.spawn(self.engines[request.engine_index], proto.GENERATE, payload, None,
                                    connect_timeout_s=self.config.timeout_s)
        self._pending[key] = (request, future)
        future.add_done_callback(lambda _: self._done.put(key))

    def _wait_one(self, timeout: float | None) -> str:
        """The key of a finished outstanding request, looking after the servers' health every `TICK_S` while
        waiting; TimeoutError after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._look_after_servers()
            left = TICK_S if deadline is None else min(TICK_S, max(0.0, deadline - time.monotonic()))
            try:
                key = self._done.get(timeout=left)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"no rollout group finished within {timeout}s; {len(self._pending)} requests "
                                       "outstanding (raise the timeout or check health())") from None
                continue
            if key in self._pending:  # keys of cancelled requests are skipped
                return key

    def _take(self, key: str) -> RolloutGroup | None:
        """A finished request's group; None when cancelled or when its server died (then it is re-dispatched)."""
        if key not in self._pending:
            return None
        request, future = self._pending.pop(key)
        try:
            body = future.result()
        except RolloutServerError as err:
            index = request.engine_index
            if isinstance(err, RolloutServerAuthError) or (self._alive[index] and self._health_problem(index) is None):
                raise
            self._orphans.append(request)
            self._mark_dead(index, str(err))
            return None
        self._watch.progressed(request.engine_index)
        if body.get("cancelled"):
            return None
        return proto.group_from_wire(body["group"], request.engine_index)
