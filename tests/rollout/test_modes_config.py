"""`rollout.mode` settings and the pieces of the server protocol that need no engine: bad values are one clear
line naming the key and the fix, verl's `sync` / `async` mean `ray`, and the token check."""
import pytest

from megatron_cpo.config import ConfigError, build_config
from megatron_cpo.rollout import http_protocol as proto
from megatron_cpo.rollout.colocate import colocated_layout, colocated_weight_transport
from megatron_cpo.rollout.server_client import ServerClientConfig

PREFIX = "actor_rollout_ref.rollout."


def test_mode_values_and_verl_aliases():
    assert build_config({}, []).actor_rollout_ref.rollout.mode == "ray"
    for verl_value in ("sync", "async"):  # verl's names: the controller always streams, so both are `ray`
        assert build_config({}, [f"{PREFIX}mode={verl_value}"]).actor_rollout_ref.rollout.mode == verl_value
    with pytest.raises(ConfigError, match=r"mode='fleet' is not supported; choose one of 'ray', 'server'"):
        build_config({}, [f"{PREFIX}mode=fleet"])


@pytest.mark.parametrize("overrides, message", [
    ([f"{PREFIX}mode=server"], r"mode=server needs actor_rollout_ref.rollout.server_urls="),
    ([f"{PREFIX}mode=server", f"{PREFIX}server_urls=[http://h:1]"], r"mode=server needs .*server_token_file"),
    ([f"{PREFIX}server_urls=[http://h:1]"], r"server_urls=\['http://h:1'\] is only used with .*mode=server"),
    ([f"{PREFIX}server_timeout_s=0"], r"server_timeout_s=0.0 must be > 0"),
])
def test_server_settings_are_checked(overrides, message):
    with pytest.raises(ConfigError, match=message):
        build_config({}, overrides)


def test_server_client_settings_name_the_bad_url():
    with pytest.raises(ValueError, match="server_urls is empty"):
        ServerClientConfig(urls=(), token="t")
    with pytest.raises(ValueError, match=r"holds '127.0.0.1:8470'; write each as http://HOST:PORT"):
        ServerClientConfig(urls=("127.0.0.1:8470",), token="t")
    assert ServerClientConfig(urls=("http://h:1/",), token="t").urls == ("http://h:1",)


def test_colocated_engines_are_one_per_rollout_tp_group_of_each_node():
    assert colocated_layout(8, 8, 2) == (1, 4) and colocated_layout(16, 8, 1) == (2, 8)
    assert colocated_layout(16, 8, 4) == (2, 2) and colocated_layout(1, 1, 1) == (1, 1)
    with pytest.raises(ValueError, match="12 ranks do not make whole nodes of 8; start every node with the same"):
        colocated_layout(12, 8, 1)
    with pytest.raises(ValueError, match="tensor_model_parallel_size=3 does not divide the 8 trainer ranks of a node"):
        colocated_layout(16, 8, 3)
    assert colocated_weight_transport("auto", 1) == "shm" and colocated_weight_transport("auto", 2) == "collective"
    assert colocated_weight_transport("collective", 1) == "collective"
    with pytest.raises(ValueError, match="weight_transport=shm reaches only engines on the sending rank's node"):
        colocated_weight_transport("shm", 2)


def test_preflight_checks_a_colocated_trainer_on_several_nodes(monkeypatch):
    from megatron_cpo.rollout.modes import rollout_mode_problems

    config = build_config({}, [f"{PREFIX}mode=colocate"])
    monkeypatch.setenv("WORLD_SIZE", "16")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # two nodes of 8 ranks: weights go over the collective transport
    assert rollout_mode_problems(config.actor_rollout_ref.rollout) == []
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    (problem,) = rollout_mode_problems(config.actor_rollout_ref.rollout)
    assert "16 ranks do not make whole nodes of 6" in problem
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    shm = build_config({}, [f"{PREFIX}mode=colocate", f"{PREFIX}weight_transport=shm"])
    (problem,) = rollout_mode_problems(shm.actor_rollout_ref.rollout)
    assert "weight_transport=shm reaches only engines on the sending rank's node" in problem and "2 nodes" in problem


def test_token_file_and_token_check(tmp_path):
    with pytest.raises(ValueError, match="does not exist; write a secret token"):
        proto.read_token_file(str(tmp_path / "missing"), "--token-file")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        proto.read_token_file(str(tmp_path / "empty"), "--token-file")
    (tmp_path / "token").write_text("  s3cret\n")
    token = proto.read_token_file(str(tmp_path / "token"), "--token-file")
    assert token == "s3cret"
    assert proto.token_matches("Bearer s3cret", token)
    assert not proto.token_matches("Bearer s3cre", token) and not proto.token_matches("s3cret", token)
    assert not proto.token_matches(None, token)
