"""Which Ray cluster the rollout engines run on: the one `RAY_ADDRESS` names, else a private local cluster whose
workers run at the trainer's priority, never whatever cluster `address="auto"` would find on a shared machine
(docs/rollout.md, "The Ray cluster").
"""
from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

PRIVATE_CLUSTER_CONFIG = {"worker_niceness": 0}  # Ray's `_system_config`; its default niceness is 15


@dataclass(frozen=True)
class RayTarget:
    """Where to connect: `address` for `ray.init` ("local" starts a private cluster) and why that one."""

    address: str
    reason: str

    @property
    def joins_existing(self) -> bool:
        return self.address != "local"


def resolve_ray_address(configured: str, environ: Mapping[str, str] | None = None) -> RayTarget:
    """`configured` ("auto", "local" or "host:port") and the environment -> the cluster to use."""
    environ = os.environ if environ is None else environ
    configured = configured.strip()
    if not configured:
        raise ValueError("ray_address is empty; use 'auto', 'local' or 'host:port'")
    if configured == "local":
        return RayTarget("local", "ray_address=local")
    if configured != "auto":
        return RayTarget(configured, f"ray_address={configured}")
    from_environment = environ.get("RAY_ADDRESS", "").strip()
    if from_environment:
        return RayTarget(from_environment, "RAY_ADDRESS is set (as the SLURM launcher sets it)")
    return RayTarget("local", "ray_address=auto and RAY_ADDRESS is not set")


def connect_ray(configured: str, namespace: str) -> bool:
    """Join or start Ray as `resolve_ray_address` says; returns True when this process connected (and must call
    `ray.shutdown()`), False when Ray was already initialised in this process."""
    import ray

    if ray.is_initialized():
        return False
    target = resolve_ray_address(configured)
    common = dict(namespace=namespace, log_to_driver=False, include_dashboard=False)
    if target.joins_existing:
        logger.info("joining the Ray cluster at %s (%s)", target.address, target.reason)
        ray.init(address=target.address, **common)
        logger.info("joined the Ray cluster at %s", ray.get_runtime_context().gcs_address)
    else:
        logger.info("starting a private local Ray cluster (%s; set RAY_ADDRESS or ray_address=host:port to join "
                    "a running one)", target.reason)
        ray.init(address="local", _system_config=PRIVATE_CLUSTER_CONFIG, **common)
    return True
