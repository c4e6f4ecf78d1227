"""`build_rollout_manager`: the rollout manager of `actor_rollout_ref.rollout.mode`, launched as the run's
`EngineLaunchConfig` says (built once by the trainer: the rollout section plus the model, dtype, lengths and seed).

Every mode returns a `RolloutEngines` (rollout/interface.py), so the trainer does not know which one it drives:
- `ray` (and verl's `sync` / `async`): `RolloutManager`, `num_engines` Ray actors on their own devices;
- `server`: `ServerRolloutManager` over running `megatron-cpo rollout` servers (`server_urls`); no Ray;
- `colocate`: `ColocatedRolloutManager`, engine servers started on the trainer's own devices (one process: here;
  a multi-node trainer: by every node's first rank, `start_colocated`); no Ray.
"""
from __future__ import annotations

from typing import Any

from megatron_cpo.rollout.config import RAY_MODES, RolloutConfig
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import EngineLaunchConfig


def build_rollout_manager(rollout: RolloutConfig, launch: EngineLaunchConfig) -> RolloutEngines:
    """Start (or connect to) the engines of `rollout.mode`, launched as `launch` says (the trainer builds it once
    from its config); called on trainer rank 0."""
    if rollout.mode in RAY_MODES:
        from megatron_cpo.rollout.manager import RolloutManager

        return RolloutManager(launch)
    if rollout.mode == "server":
        from megatron_cpo.rollout.http_protocol import read_token_file
        from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager

        transport = "collective" if rollout.weight_transport == "auto" else rollout.weight_transport
        return ServerRolloutManager(ServerClientConfig(
            urls=tuple(rollout.server_urls),
            token=read_token_file(rollout.server_token_file, "actor_rollout_ref.rollout.server_token_file"),
            timeout_s=rollout.server_timeout_s, weight_transport=transport,
            weight_sync_bucket_bytes=launch.weight_sync_bucket_bytes,
            weight_sync_timeout_s=rollout.weight_sync_timeout_s, min_model_len=launch.max_model_len,
            health=rollout.engine_health))
    if rollout.mode == "colocate":
        from megatron_cpo.rollout.colocate import ColocatedRolloutManager, colocated_layout, torchrun_world

        _, _, world_size, local_world_size = torchrun_world()
        nodes, per_node = colocated_layout(world_size, local_world_size, rollout.tensor_model_parallel_size)
        if nodes > 1:
            raise ValueError(f"the colocated trainer spans {nodes} nodes: its engines are started on every node by "
                             "the trainer itself (run_training without a manager), not by build_rollout_manager")
        return ColocatedRolloutManager.start(launch, per_node, **colocated_client_settings(rollout, launch))
    raise ValueError(f"actor_rollout_ref.rollout.mode={rollout.mode!r}; use ray, server or colocate")


def colocated_client_settings(rollout: RolloutConfig, launch: EngineLaunchConfig) -> dict[str, Any]:
    """`ColocatedRolloutManager`'s settings (besides where the servers are)."""
    return {"timeout_s": rollout.server_timeout_s, "min_model_len": launch.max_model_len,
            "sleep_level": rollout.sleep_level if rollout.free_cache_engine else 0}


def start_colocated(rollout: RolloutConfig, launch: EngineLaunchConfig, exchange: Any) -> tuple[Any, Any]:
    """`rollout/colocate.py` `start_colocated_engines` for a run's engines; every trainer rank calls it together."""
    from megatron_cpo.rollout.colocate import start_colocated_engines

    return start_colocated_engines(launch, exchange, colocated_client_settings(rollout, launch))


def rollout_mode_problems(rollout: RolloutConfig) -> list[str]:
    """Preflight, before anything starts. `mode=server`: each of `server_urls` answers a healthy `/health` within
    `server_timeout_s`, and the token file is readable. `mode=colocate`: every node runs the same number of ranks,
    the rollout TP divides them, and the weight transport reaches every node. Other modes: no problems."""
    import json
    import urllib.error
    import urllib.request

    from megatron_cpo.rollout.http_protocol import HEALTH, read_token_file

    if rollout.mode == "colocate":
        from megatron_cpo.rollout.colocate import colocated_layout, colocated_weight_transport, torchrun_world

        _, _, world_size, local_world_size = torchrun_world()
        try:
            nodes, _ = colocated_layout(world_size, local_world_size, rollout.tensor_model_parallel_size)
            colocated_weight_transport(rollout.weight_transport, nodes)
        except ValueError as err:
            return [str(err)]
    if rollout.mode != "server":
        return []
    problems = []
    try:
        read_token_file(rollout.server_token_file, "actor_rollout_ref.rollout.server_token_file")
    except ValueError as err:
        problems.append(str(err))
    for url in rollout.server_urls:
        try:
            with urllib.request.urlopen(url.rstrip("/") + HEALTH, timeout=rollout.server_timeout_s) as response:
                body = json.loads(response.read())
            if not body.get("ok"):
                problems.append(f"rollout server {url} is unhealthy: {body.get('problems')}")
        except urllib.error.HTTPError as err:
            problems.append(f"rollout server {url} answered /health with HTTP {err.code}; is it a megatron-cpo "
                            "rollout server and are its engines alive?")
        except (OSError, ValueError) as err:  # refused, unreachable, timed out, not JSON
            problems.append(f"actor_rollout_ref.rollout.server_urls: {url} did not answer /health within "
                            f"server_timeout_s={rollout.server_timeout_s}s ({type(err).__name__}: {err}); start it "
                            "with `megatron-cpo rollout` or fix the URL")
    return problems
