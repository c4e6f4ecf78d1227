"""Which Ray cluster a run uses: a private local one unless RAY_ADDRESS (the SLURM launcher's) or an explicit
address says otherwise. Never `ray.init(address="auto")`, which joins any cluster found on the machine."""
import pytest

from megatron_cpo.rollout.ray_cluster import resolve_ray_address


def test_auto_without_ray_address_starts_a_private_cluster():
    target = resolve_ray_address("auto", {})
    assert target.address == "local" and not target.joins_existing
    assert resolve_ray_address("auto", {"RAY_ADDRESS": "  "}).address == "local"


def test_auto_joins_the_cluster_in_ray_address():
    target = resolve_ray_address("auto", {"RAY_ADDRESS": "node0:6379"})
    assert target.address == "node0:6379" and target.joins_existing and "RAY_ADDRESS" in target.reason


def test_local_ignores_ray_address_and_explicit_address_wins():
    assert resolve_ray_address("local", {"RAY_ADDRESS": "node0:6379"}).address == "local"
    target = resolve_ray_address("10.0.0.2:6380", {"RAY_ADDRESS": "node0:6379"})
    assert target.address == "10.0.0.2:6380" and target.joins_existing


def test_empty_address_is_an_error():
    with pytest.raises(ValueError, match="ray_address is empty"):
        resolve_ray_address(" ", {})
