"""Engine-free pieces: sampling-parameter validation, per-sample seeds, bucket packing and shared-memory files."""
import os

import pytest
import torch

from megatron_cpo.rollout import EngineLaunchConfig, RolloutEngineConfig, SamplingParams, derive_sample_seeds
from megatron_cpo.rollout.buckets import iter_buckets, read_bucket, release_bucket, write_bucket


def test_sample_seeds_are_deterministic_distinct_and_do_not_overlap_between_nearby_groups():
    seeds = SamplingParams(n=8, seed=7).sample_seeds()
    assert seeds == derive_sample_seeds(7, 8)
    assert len(set(seeds)) == 8
    assert not set(seeds) & set(derive_sample_seeds(8, 8))
    assert SamplingParams(n=3).sample_seeds() == [None, None, None]


@pytest.mark.parametrize("field, value, hint", [("n", 0, "n >= 1"), ("temperature", -1.0, "greedy"),
                                                 ("top_p", 0.0, "(0, 1]"), ("top_k", 0, "-1"),
                                                 ("max_tokens", 0, ">= 1")])
def test_bad_sampling_params_name_the_value_and_the_fix(field, value, hint):
    with pytest.raises(ValueError, match=rf"{field}={value}") as err:
        SamplingParams(**{field: value})
    assert hint in str(err.value)


def test_rollout_config_rejects_missing_model_dir(tmp_path):
    with pytest.raises(ValueError, match="model_path=.*not a directory"):
        EngineLaunchConfig(model_path=str(tmp_path / "missing"))


def test_buckets_respect_the_size_and_round_trip_through_shared_memory():
    tensors = [(f"w{i}", torch.randn(33, 7, dtype=dtype)) for i, dtype in
               enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.float32])]
    tensors.append(("big", torch.randn(4096)))  # larger than a bucket: travels alone
    tensors.append(("strided", torch.randn(8, 6).t()))  # non-contiguous input is packed contiguously
    buckets = list(iter_buckets(iter(tensors), bucket_bytes=2048))
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in tensors]
    assert ["big"] in [[name for name, _ in bucket] for bucket in buckets]
    for bucket in buckets:
        spec = write_bucket(bucket, prefix="test")
        assert os.path.exists(spec.path)
        loaded = dict(read_bucket(type(spec).from_wire(spec.to_wire())))
        for name, tensor in bucket:
            assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor)
        release_bucket(spec)
        assert not os.path.exists(spec.path)


@pytest.mark.parametrize("field, value, shown, hint", [
    ("weight_transport", "nccl", "'nccl'", "'auto', 'shm', 'collective'"), ("weight_sync_timeout_s", 0, "0", "> 0"),
    ("tensor_model_parallel_size", 0, "0", ">= 1"), ("kv_cache_gib", 0, "0", "> 0"),
    ("kv_cache_gib", "lots", "'lots'", "or auto")])
def test_rollout_engine_config_rejects_bad_settings(field, value, shown, hint):
    with pytest.raises(ValueError, match=f"rollout.{field}={shown}") as err:
        RolloutEngineConfig(**{field: value})
    assert hint in str(err.value)


def test_auto_kv_cache_fits_the_sequences_within_a_share_of_the_free_memory(tmp_path):
    """`kv_cache_gib: auto`: K and V of every layer (SmolLM2's shape: 30 layers, 3 KV heads of 64, float32: 46,080
    bytes a token) for max_num_seqs sequences in 128-token blocks, capped by a quarter of the free memory split over
    the engines, at least 1 GiB; an explicit size is kept."""
    import json

    from megatron_cpo.rollout.cpu_resources import GIB, auto_kv_cache_gib, kv_bytes_per_token

    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 576, "num_attention_heads": 9,
                                                      "num_key_value_heads": 3, "num_hidden_layers": 30}))
    model = str(tmp_path)
    assert kv_bytes_per_token(model, "float32") == 2 * 30 * 3 * 64 * 4 == 46_080
    assert kv_bytes_per_token(model, "bfloat16") == 23_040
    # 256 sequences x 1,024 tokens x 46,080 bytes = 11.25 GiB wanted
    assert auto_kv_cache_gib(model, "float32", 1000, 256, engines=1, available_bytes=100 * GIB) == 12
    assert auto_kv_cache_gib(model, "float32", 1000, 256, engines=2, available_bytes=40 * GIB) == 5  # 40 / 4 / 2
    assert auto_kv_cache_gib(model, "float32", 180, None, engines=1, available_bytes=100 * GIB) == 2  # 128 x 256
    assert auto_kv_cache_gib(model, "float32", 1000, 256, engines=1, available_bytes=2 * GIB) == 1  # at least 1
    assert auto_kv_cache_gib(str(tmp_path / "missing"), "float32", 1000, 256, 1, 100 * GIB) == 1
    explicit = EngineLaunchConfig(model_path=model, engines=RolloutEngineConfig(kv_cache_gib=2.5))
    assert explicit.kv_cache_space_gib == 3
    auto = EngineLaunchConfig(model_path=model, dtype="float32", max_model_len=180)
    assert auto.engines.kv_cache_gib == "auto" and 1 <= auto.kv_cache_space_gib <= 2

