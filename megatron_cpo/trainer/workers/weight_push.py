"""The weight push, collective because every pipeline stage exports its own layers: each stage's exporting rank
streams the actor's weights (HF names, full tensors) into the engines rank 0 drives."""
from __future__ import annotations

import os
import time
from typing import Any

from megatron.core import parallel_state

from megatron_cpo.models import iter_hf_weights
from megatron_cpo.rollout import send_from_pipeline_stages
from megatron_cpo.rollout.interface import RolloutEngines
from megatron_cpo.trainer.collectives import barrier, broadcast_object

# Ray's token authentication settings of the cluster rank 0 started; other ranks need them to connect to it.
RAY_AUTH_VARIABLES = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def push_weights(actor_model: Any, manager: RolloutEngines | None, in_flight: str = "none", resume: bool = True
                 ) -> tuple[dict[str, float], dict[str, list[dict]] | None]:
    """Stream the actor's weights (HF names, full tensors) from each stage's exporting rank into the engines over the
    configured transport (rollout.weight_transport); `manager` is rank 0's rollout manager (None elsewhere);
    `in_flight`: what the engines do with requests still generating (types.IN_FLIGHT_POLICIES; asynchronous
    training); `resume=False` leaves them paused for the sync probe (`RolloutEngines.finish_weight_sync`).
    Returns the sync time and this rank's bytes, and on rank 0 the engines' reload reports (None elsewhere)."""
    start = time.perf_counter()
    payload = [None, None]
    if manager is not None:
        manager.begin_weight_sync(in_flight)
        payload = [manager.sender_spec(), {k: os.environ[k] for k in RAY_AUTH_VARIABLES if k in os.environ}]
    spec, ray_auth = broadcast_object(payload)
    if manager is None:
        os.environ.update(ray_auth)  # a sending rank joins rank 0's Ray cluster with its authentication mode
    tensors = iter_hf_weights(actor_model, actor_model.hf_config)  # every rank: experts are gathered over EP/ETP
    sent = send_from_pipeline_stages(spec, tensors, parallel_state.get_pipeline_model_parallel_rank(),
                                     parallel_state.get_pipeline_model_parallel_world_size())
    barrier()
    reports = manager.finish_weight_sync(resume) if manager is not None else None
    return ({"timing/weight_sync_s": time.perf_counter() - start, "weight_sync/bytes": float(sent.get("bytes", 0))},
            reports)
