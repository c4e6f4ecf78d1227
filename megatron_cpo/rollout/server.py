"""`megatron-cpo rollout`: vLLM engines served over HTTP, without Ray (`rollout.mode=server` and `colocate`).

One process holds `--data-parallel-size` `VLLMEngine`s (each over `--tensor-parallel-size` devices) on one asyncio
event loop and answers the routes of `http_protocol`:
- `POST /generate` takes one prompt and `SamplingParams` and answers when the group's n samples are done (a long
  poll per group: the client holds one request per prompt in flight and receives each group as soon as it
  finishes), or `{"cancelled": true}` when `/cancel` aborted it;
- `POST /cancel` aborts every group in flight; `GET /health` (no token) says whether every engine and its
  processes are alive;
- weights: `/weights/begin`, then buckets by shared memory (`/weights/load_shm`, the server on the sender's node) or
  by a gloo/NCCL group that the server's engine workers join at the sender's `host:port` (`/weights/join`, then one
  `/weights/receive` per broadcast bucket), then `/weights/finish` (answers the engines' reload reports); `/sync_probe`
  then has every engine continue the trainer's probe prompts greedily (rollout/sync_check.py), and `/weights/resume`
  lets the requests that a push finished with `resume=false` held back go on. A server takes weights from one
  trainer run at a time: a run joining closes the groups of other runs (a trainer that died never left its group);
- `POST /score` scores one group's responses as a distillation teacher (rollout/scoring.py);
- `/sleep` and `/wake_up` (vLLM's sleep mode on GPUs; on CPU they do nothing and say so once in the log).
Every route but `/health` needs the token given at start (`--token-file`). The server binds to 127.0.0.1 unless
`--host` says otherwise. `--ready-file` receives the server's URL once the engines are up (with `--port 0` the OS
picks the port), so a launcher can wait for it.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import uuid
from pathlib import Path

from megatron_cpo.compute_dtype import PARAMS_DTYPES, resolve_dtype
from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.buckets import BucketSpec
from megatron_cpo.rollout.types import EngineLaunchConfig, RolloutEngineConfig

logger = logging.getLogger(__name__)


class RolloutServer:
    """The engines of one server process and the aiohttp application that exposes them."""

    def __init__(self, config: EngineLaunchConfig, data_parallel_size: int, token: str) -> None:
        from megatron_cpo.rollout.engine import VLLMEngine

        self.config, self.token = config, token
        self.engines = [VLLMEngine(config, index) for index in range(data_parallel_size)]
        self._load = [0] * data_parallel_size
        self._group_sessions: dict[str, str] = {}  # weight-sync group name -> the trainer run that opened it

    def app(self):
        from aiohttp import web

        app = web.Application(middlewares=[self._token_middleware()], client_max_size=64 * 1024**2)
        app.router.add_get(proto.HEALTH, self.health)
        for route, handler in ((proto.GENERATE, self.generate), (proto.CANCEL, self.cancel),
                               (proto.CHECK_TOKEN, self.check_token),
                               (proto.WEIGHTS_BEGIN, self.weights_begin), (proto.WEIGHTS_LOAD_SHM, self.load_shm),
                               (proto.WEIGHTS_JOIN, self.join), (proto.WEIGHTS_RECEIVE, self.receive),
                               (proto.WEIGHTS_LEAVE, self.leave), (proto.WEIGHTS_FINISH, self.weights_finish),
                               (proto.WEIGHTS_RESUME, self.weights_resume), (proto.SYNC_PROBE, self.sync_probe),
                               (proto.SCORE, self.score),
                               (proto.SLEEP, self.sleep), (proto.WAKE_UP, self.wake_up)):
            app.router.add_post(route, handler)
        return app

    def _token_middleware(self):
        """Refuse every route but /health without the token (401); turn an engine error into a 500 answer."""
        from aiohttp import web

        @web.middleware
        async def checked(request, handler):
            if request.path not in proto.OPEN_ROUTES and not proto.token_matches(
                    request.headers.get("Authorization"), self.token):
                return web.json_response({"error": f"{request.path} needs this server's token (Authorization: "
                                                   "Bearer <token>); the given one is missing or wrong"}, status=401)
            try:
                return await handler(request)
            except web.HTTPException:
                raise
            except Exception as err:  # noqa: BLE001 - an engine error is the caller's answer, not the server's end
                logger.warning("%s failed: %s", request.path, err)
                return web.json_response({"error": f"{type(err).__name__}: {err}"}, status=500)
        return checked

    async def health(self, request):
        from aiohttp import web

        problems = []
        for index, engine in enumerate(self.engines):
            try:
                await asyncio.wait_for(engine.is_healthy(), self.config.health_timeout_s)
            except Exception as err:  # noqa: BLE001 - any failure is an unhealthy engine
                problems.append(f"engine {index}: {type(err).__name__}: {err}")
        body = {"ok": not problems, "problems": problems, "engines": len(self.engines),
                "workers_per_engine": self.config.engines.tensor_model_parallel_size, "model": self.config.model_path,
                "max_model_len": self.config.max_model_len, "outstanding": sum(self._load)}
        return web.json_response(body, status=200 if not problems else 503)

    async def generate(self, request):
        from aiohttp import web

        body = await request.json()
        index = min(range(len(self.engines)), key=lambda i: (self._load[i], i))
        self._load[index] += 1
        # vLLM request ids must be unique within the engine: two clients may both send "uid-0"
        engine_request_id = f"{uuid.uuid4().hex[:12]}:{body['request_id']}"
        try:
            group = await self.engines[index].generate(engine_request_id, body["prompt_token_ids"],
                                                       proto.params_from_wire(body["params"]))
        finally:
            self._load[index] -= 1
        if group is None:
            return web.json_response({"cancelled": True})
        group.request_id = body["request_id"]
        return web.json_response({"group": proto.group_to_wire(group)})

    async def score(self, request):
        """A distillation teacher's scores of one group's responses (`VLLMEngine.score`) on the least-loaded
        engine."""
        import dataclasses

        from aiohttp import web

        from megatron_cpo.rollout.scoring import ScoreRequest

        body = await request.json()
        index = min(range(len(self.engines)), key=lambda i: (self._load[i], i))
        self._load[index] += 1
        try:
            group = await self.engines[index].score(ScoreRequest(**body))
        finally:
            self._load[index] -= 1
        return web.json_response(dataclasses.asdict(group))

    async def check_token(self, request):
        """Answers only when the token is right (the middleware refuses it otherwise); changes nothing."""
        from aiohttp import web

        return web.json_response({"ok": True})

    async def cancel(self, request):
        from aiohttp import web

        counts = await asyncio.gather(*(engine.cancel_all() for engine in self.engines))
        return web.json_response({"cancelled": sum(counts)})

    async def _on_every_engine(self, method: str, *args):
        return await asyncio.gather(*(getattr(engine, method)(*args) for engine in self.engines))

    async def weights_begin(self, request):
        """`in_flight` (types.IN_FLIGHT_POLICIES): what the reload does with the groups still generating."""
        from aiohttp import web

        body = await _json_body(request)
        await self._on_every_engine("begin_weight_reload", body.get("in_flight", "none"))
        return web.json_response({"ok": True})

    async def weights_finish(self, request):
        """Closes every engine's reload; `version` labels the tokens sampled on the new weights (the client's
        weight_version); `resume=false` leaves the requests the push paused waiting for `/weights/resume`.
        Answers each engine's per-worker reload reports."""
        from aiohttp import web

        body = await _json_body(request)
        reports = await self._on_every_engine("finish_weight_reload", body.get("version"), body.get("resume", True))
        return web.json_response({"ok": True, "reports": reports})

    async def weights_resume(self, request):
        """Lets the requests paused by a push finished with `resume=false` go on (`VLLMEngine.resume_generation`)."""
        from aiohttp import web

        await self._on_every_engine("resume_generation")
        return web.json_response({"ok": True})

    async def sync_probe(self, request):
        """Every engine's greedy continuation of each probe prompt (`VLLMEngine.sync_probe`), per engine."""
        from aiohttp import web

        body = await request.json()
        answers = await self._on_every_engine("sync_probe", body["prompts"], int(body["max_tokens"]))
        return web.json_response({"engines": [[proto.sample_to_wire(sample) for sample in samples]
                                              for samples in answers]})

    async def load_shm(self, request):
        from aiohttp import web

        spec = BucketSpec.from_wire((await request.json())["bucket"])
        counts = await self._on_every_engine("load_weight_bucket", spec)
        return web.json_response({"tensors": counts[0]})

    async def join(self, request):
        """Engine i's workers take group ranks first_rank + i * tensor_parallel_size ..; the groups of other runs
        (sessions) are left first. A run with several sending ranks (pipeline stages) keeps one group per rank."""
        from aiohttp import web

        body = await request.json()
        for name, session in list(self._group_sessions.items()):
            if session != body["session"]:  # an older run's group (it may have died without leaving)
                await self._on_every_engine("leave_weight_group", name)
                del self._group_sessions[name]
        self._group_sessions[body["name"]] = body["session"]
        workers = self.config.engines.tensor_model_parallel_size
        first_rank = int(body["first_rank"])
        ranks = await asyncio.gather(*(
            engine.join_weight_group(body["name"], body["host"], int(body["port"]), first_rank + i * workers,
                                     int(body["world_size"]), float(body["timeout_s"]))
            for i, engine in enumerate(self.engines)))
        return web.json_response({"ranks": [rank for engine_ranks in ranks for rank in engine_ranks]})

    async def receive(self, request):
        from aiohttp import web

        body = await request.json()
        counts = await self._on_every_engine("receive_weight_bucket", body["name"], body["entries"],
                                             int(body["nbytes"]))
        return web.json_response({"tensors": counts[0]})

    async def leave(self, request):
        from aiohttp import web

        name = (await request.json()).get("name")
        await self._on_every_engine("leave_weight_group", name)
        if name is None:
            self._group_sessions.clear()
        else:
            self._group_sessions.pop(name, None)
        return web.json_response({"ok": True})

    async def sleep(self, request):
        """vLLM's sleep mode on every engine (`VLLMEngine.sleep`: where it cannot sleep, e.g. on CPU, it says why
        once in the log and nothing happens)."""
        from aiohttp import web

        level = int((await request.json()).get("level", 1))
        slept = await asyncio.gather(*(engine.sleep(level) for engine in self.engines))
        return web.json_response({"slept": all(slept)})

    async def wake_up(self, request):
        from aiohttp import web

        woke = await asyncio.gather(*(engine.wake_up() for engine in self.engines))
        return web.json_response({"woke": all(woke)})


    async def close(self) -> None:
        for engine in self.engines:
            await engine.shutdown()


async def _json_body(request) -> dict:
    """The request's JSON object ({} when it has no body)."""
    return await request.json() if request.can_read_body else {}


async def serve(config: EngineLaunchConfig, data_parallel_size: int, token: str, host: str, port: int,
                ready_file: str | None = None) -> None:
    """Start the engines, serve until SIGTERM/SIGINT, then stop the engines."""
    from aiohttp import web

    server = RolloutServer(config, data_parallel_size, token)
    runner = web.AppRunner(server.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound_port = runner.addresses[0][1]
    url = f"http://{host}:{bound_port}"
    logger.info("rollout server for %s (%d engine(s) x TP %d) listening on %s", config.model_path,
                data_parallel_size, config.engines.tensor_model_parallel_size, url)
    if ready_file:
        partial = Path(f"{ready_file}.partial")
        partial.write_text(url)
        partial.rename(ready_file)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    try:
        await stop.wait()
    finally:
        logger.info("rollout server on %s stopping", url)
        await runner.cleanup()
        await server.close()
        logger.info("rollout server on %s stopped", url)


def add_rollout_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--model", required=True, help="Hugging Face model directory the engines serve")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="devices per engine (vLLM TP)")
    parser.add_argument("--data-parallel-size", type=int, default=1, help="engines in this server")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8470, help="port to bind (0: the OS picks one)")
    parser.add_argument("--token-file", required=True,
                        help="file holding the secret every request but /health must carry")
    parser.add_argument("--dtype", default="auto", choices=PARAMS_DTYPES,
                        help="engine weights' dtype (the trainer's actor.megatron.params_dtype); auto: bfloat16 where "
                        "the machine multiplies it natively, else float32")
    parser.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + response, in tokens")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.6,
                        help="fraction of each GPU vLLM may fill (weights + KV cache)")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="KV cache of each CPU engine, GiB")
    parser.add_argument("--seed", type=int, default=0, help="engine seed (unseeded requests' sampling)")
    parser.add_argument("--enable-sleep-mode", action="store_true",
                        help="let /sleep free the engines' GPU memory (vLLM sleep mode; no effect on CPU)")
    parser.add_argument("--max-logprobs", type=int, default=20,
                        help="most log-probs per position a request may ask (a distillation teacher's top-k)")
    parser.add_argument("--ready-file", default=None, help="write the server's URL here once it serves")
    return parser


def run_rollout_command(args: argparse.Namespace) -> None:
    if args.data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size={args.data_parallel_size}; set it >= 1")
    token = proto.read_token_file(args.token_file, "--token-file")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_cache_gib))
    engines = RolloutEngineConfig(tensor_model_parallel_size=args.tensor_parallel_size,
                                  gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib)
    dtype = resolve_dtype(args.dtype)
    dtype.announce(logger, "the engines", "--dtype")
    config = EngineLaunchConfig(model_path=args.model, engines=engines, dtype=dtype.name,
                                max_model_len=args.max_model_len, seed=args.seed,
                                enable_sleep_mode=args.enable_sleep_mode, max_logprobs=args.max_logprobs)
    asyncio.run(serve(config, args.data_parallel_size, token, args.host, args.port, args.ready_file))
