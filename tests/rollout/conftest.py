"""Shared rollout fixtures: one two-engine manager for every rollout test (an engine takes tens of seconds to start on
CPU, so tests share them), in the session's private Ray cluster, serving a tiny float32 Qwen2 with tied embeddings and
qkv biases (`tied_qwen2_dir`, tests/conftest.py). It is stopped when the last rollout test is done, so that its
engines' memory and Ray CPU slots are free for the trainer tests' engines."""
from __future__ import annotations

import os

import pytest

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def tiny_rollout_config(model_dir, num_engines=2, restart=True):
    from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig
    from megatron_cpo.rollout.config import EngineHealthConfig

    return EngineLaunchConfig(model_path=str(model_dir), engines=RolloutEngineConfig(
        num_engines=num_engines, kv_cache_gib=1, ray_address="local", engine_health=EngineHealthConfig(
            restart=restart)), dtype="float32", max_model_len=512, engine_start_timeout_s=1200,
        weight_sync_bucket_mb=0.25)


@pytest.fixture(scope="package")
def manager(ray_cluster, tied_qwen2_dir):
    """Two float32 engines on the tied tiny Qwen2, shared by every test that leaves them idle and healthy."""
    from megatron_cpo.rollout import RolloutManager

    rollout = RolloutManager(tiny_rollout_config(tied_qwen2_dir))
    yield rollout
    rollout.shutdown()
