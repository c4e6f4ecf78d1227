"""`build_rollout_manager`: the rollout manager of `actor_rollout_ref.rollout.mode` for a run's config.

Every mode returns a `RolloutEngines` (rollout/interface.py), so the trainer does not know which one it drives:
- `ray` (and verl's `sync` / `async`): `RolloutManager`, `num_engines` Ray actors on their own devices;
- `server`: `ServerRolloutManager` over running `megatron-cpo rollout` servers (`server_urls`); no Ray;
- `colocate`: `ColocatedRolloutManager`, engine servers started on the trainer's own devices (one process: here;
  a multi-node trainer: by every node's first rank, `start_colocated`); no Ray.
"""
from __future__ import annotations

from typing import Any

from megatron_cpo.rollout.config import RAY_MODES
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.rollout.types import EngineLaunchConfig


def engine_config(config: Any) -> EngineLaunchConfig:
    """The engines' launch settings for a run's `Config`: the user's `actor_rollout_ref.rollout` as given, plus the
    model, dtype, lengths and seed; colocated GPU engines start able to sleep when `rollout.free_cache_engine`, and
    engines that generate while the trainer trains (asynchronous training) know it."""
    data, rollout = config.data, config.actor_rollout_ref.rollout
    return EngineLaunchConfig(
        model_path=config.actor_rollout_ref.model.path, engines=rollout,
        dtype=config.actor_rollout_ref.actor.megatron.compute_dtype,
        max_model_len=data.max_prompt_length + data.max_response_length, seed=config.trainer.seed,
        enable_sleep_mode=rollout.mode == "colocate" and rollout.free_cache_engine,
        overlaps_training=config.async_training.max_staleness > 0)


def build_rollout_manager(config: Any) -> RolloutEngines:
    """Start (or connect to) the engines of `config.actor_rollout_ref.rollout.mode`; called on trainer rank 0."""
    rollout = config.actor_rollout_ref.rollout
    engines = engine_config(config)
    if rollout.mode in RAY_MODES:
        from megatron_cpo.rollout.manager import RolloutManager

        return RolloutManager(engines)
    if rollout.mode == "server":
        from megatron_cpo.rollout.http_protocol import read_token_file
        from megatron_cpo.rollout.server_client import ServerClientConfig, ServerRolloutManager

        transport = "collective" if rollout.weight_transport == "auto" else rollout.weight_transport
        return ServerRolloutManager(ServerClientConfig(
            urls=tuple(rollout.server_urls),
            token=read_token_file(rollout.server_token_file, "actor_rollout_ref.rollout.server_token_file"),
            timeout_s=rollout.server_timeout_s, weight_transport=transport,
            weight_sync_bucket_bytes=engines.weight_sync_bucket_bytes,
            weight_sync_timeout_s=rollout.weight_sync_timeout_s, min_model_len=engines.max_model_len))
    if rollout.mode == "colocate":
        from megatron_cpo.rollout.colocate import ColocatedRolloutManager, colocated_layout, torchrun_world

        _, _, world_size, local_world_size = torchrun_world()
        nodes, per_node = colocated_layout(world_size, local_world_size, rollout.tensor_model_parallel_size)
        if nodes > 1:
            raise ValueError(f"the colocated trainer spans {nodes} nodes: its engines are started on every node by "
                             "the trainer itself (run_training without a manager), not by build_rollout_manager")
        return ColocatedRolloutManager.start(engines, per_node, **colocated_client_settings(config))
    raise ValueError(f"actor_rollout_ref.rollout.mode={rollout.mode!r}; use ray, server or colocate")


def colocated_client_settings(config: Any) -> dict[str, Any]:
    """`ColocatedRolloutManager`'s settings from a run's config (besides where the servers are)."""
    rollout = config.actor_rollout_ref.rollout
    return {"timeout_s": rollout.server_timeout_s, "min_model_len": engine_config(config).max_model_len,
            "sleep_level": rollout.sleep_level if rollout.free_cache_engine else 0}


def start_colocated(config: Any, exchange: Any) -> tuple[Any, Any]:
    """`rollout/colocate.py` `start_colocated_engines` for a run's config; every trainer rank calls it together."""
    from megatron_cpo.rollout.colocate import start_colocated_engines

    return start_colocated_engines(engine_config(config), exchange, colocated_client_settings(config))


def rollout_mode_problems(config: Any) -> list[str]:
    """Preflight, before anything starts. `mode=server`: each of `server_urls` answers a healthy `/health` within
    `server_timeout_s`, and the token file is readable. `mode=colocate`: every node runs the same number of ranks,
    the rollout TP divides them, and the weight transport reaches every node. Other modes: no problems."""
    import json
    import urllib.error
    import urllib.request

    from megatron_cpo.rollout.http_protocol import HEALTH, read_token_file

    rollout = config.actor_rollout_ref.rollout
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
