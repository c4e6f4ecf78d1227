"""The rollout server's HTTP protocol: routes, the token check and the JSON forms of requests and results.

Shared by the server (`server.py`) and its client (`server_client.py`) so both sides agree on one definition.
Every route except `GET /health` needs `Authorization: Bearer <token>` (the token the server was started with):
generation and cancellation as well as the weight-update and admin routes, so a server reachable by others never
serves or takes weights from a caller without the token.
"""
from __future__ import annotations

import dataclasses
import hmac
from pathlib import Path

from megatron_cpo.rollout.types import RolloutGroup, RolloutSample, SamplingParams

HEALTH = "/health"
GENERATE = "/generate"
CANCEL = "/cancel"
CHECK_TOKEN = "/check_token"
WEIGHTS_BEGIN = "/weights/begin"
WEIGHTS_LOAD_SHM = "/weights/load_shm"
WEIGHTS_JOIN = "/weights/join"
WEIGHTS_RECEIVE = "/weights/receive"
WEIGHTS_LEAVE = "/weights/leave"
WEIGHTS_FINISH = "/weights/finish"
WEIGHTS_RESUME = "/weights/resume"
SYNC_PROBE = "/sync_probe"
SCORE = "/score"
SLEEP = "/sleep"
WAKE_UP = "/wake_up"
OPEN_ROUTES = frozenset({HEALTH})


def read_token_file(path: str, what: str) -> str:
    """The token stored in `path` (surrounding whitespace dropped); a clear error when missing or empty."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{what}={path!r} does not exist; write a secret token into that file (e.g. "
                         "`python -c 'import secrets; print(secrets.token_hex(32))' > FILE`)")
    token = file.read_text().strip()
    if not token:
        raise ValueError(f"{what}={path!r} is empty; write a secret token into it")
    return token


def authorization_header(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def token_matches(header: str | None, token: str) -> bool:
    """Whether an Authorization header carries `token` (compared in constant time)."""
    if not header or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].encode(), token.encode())


def params_to_wire(params: SamplingParams) -> dict:
    wire = dataclasses.asdict(params)
    wire["stop_token_ids"] = list(params.stop_token_ids)
    return wire


def params_from_wire(wire: dict) -> SamplingParams:
    return SamplingParams(**{**wire, "stop_token_ids": tuple(wire.get("stop_token_ids", ()))})


def sample_to_wire(sample: RolloutSample | None) -> dict | None:
    return dataclasses.asdict(sample) if sample is not None else None


def sample_from_wire(wire: dict | None) -> RolloutSample | None:
    return RolloutSample(**wire) if wire is not None else None


def group_to_wire(group: RolloutGroup) -> dict:
    return dataclasses.asdict(group)


def group_from_wire(wire: dict, engine_index: int) -> RolloutGroup:
    """A group as the client sees it: `engine_index` is the server's position in `rollout.server_urls`."""
    samples = [sample_from_wire(sample) for sample in wire["samples"]]
    return RolloutGroup(request_id=wire["request_id"], prompt_token_ids=list(wire["prompt_token_ids"]),
                        samples=samples, engine_index=engine_index, finished_at=wire.get("finished_at"))
