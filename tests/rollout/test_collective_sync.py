"""Weight sync over the collective transport (gloo here; NCCL on GPUs differs only in backend and device, and cannot
run on this CPU-only machine): a real weight-sync group between this process and both engines' workers carries
changed weights that the engines then reproduce token for token, and a group member that never joins is a clear
error naming the store's address, after which the engine still serves."""
import pytest
import torch

from megatron_cpo.rollout import SamplingParams, WeightGroupJoinError, WeightSender
from megatron_cpo.rollout.weight_sync import _open_groups
from tests.rollout.servers import greedy_log_prob_gap

PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90], [1, 33, 3], [1, 100, 101, 102, 103, 104]]


def _perturbed(model, seed):
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    return model


def test_collective_sync_reproduces_transformers_greedy_tokens_and_logprobs_and_reuses_its_group(manager,
                                                                                                 tied_qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf_model = _perturbed(AutoModelForCausalLM.from_pretrained(tied_qwen2_dir, dtype=torch.float32), 11)
    first = manager.sync_weights(hf_model.state_dict().items(), transport="collective")
    _perturbed(hf_model, 12)  # change the weights again: the second sync must replace them over the same group
    second = manager.sync_weights(hf_model.state_dict().items(), transport="collective")
    expected_bytes = sum(p.numel() * p.element_size() for p in hf_model.state_dict().values())
    print(f"collective sync: first {first['seconds']:.3f}s (group init {first['group_init_seconds']:.3f}s), "
          f"second {second['seconds']:.3f}s, {second['buckets']:.0f} buckets, {expected_bytes / 2**20:.2f} MiB")
    assert first["group_init_seconds"] > 0 and second["group_init_seconds"] == 0
    assert second["bytes"] == expected_bytes and second["buckets"] > 1

    for i, prompt in enumerate(PROMPTS):
        manager.submit(f"collective-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10))
    groups = list(manager.completed(timeout=300))
    assert {g.engine_index for g in groups} == {0, 1}, "both engines must have received the weights"
    max_diff = greedy_log_prob_gap(hf_model, groups)
    print(f"collective sync: max |engine - transformers| log-prob difference {max_diff:.2e}")
    assert max_diff < 1e-4


def test_a_group_member_that_never_joins_is_a_clear_error_and_the_engine_keeps_serving(manager):
    """The spec claims two workers per engine while the engine has one, so group rank 2 never joins."""
    import dataclasses

    spec = dataclasses.replace(manager.sender_spec("collective"), engine_names=manager.engine_names[:1],
                               workers_per_engine=2, timeout_s=3.0)
    manager.begin_weight_sync()
    try:
        with pytest.raises(WeightGroupJoinError, match=r"at \d+\.\d+\.\d+\.\d+:\d+: ranks \[2\] of 3 never joined"
                           ) as err:
            WeightSender(spec, engine_handles=manager.engines[:1]).send(iter([("unused", torch.zeros(1))]))
    finally:
        manager.finish_weight_sync()
    print(err.value)
    assert "weight_sync_timeout_s" in str(err.value)
    assert _open_groups.get(spec) is None
    assert manager.health() == [True, True]
    manager.submit("after-failed-join", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4))
    (group,) = manager.completed(timeout=300)
    assert len(group.samples[0].token_ids) == 4


def test_auto_transport_is_shm_on_one_node_and_collective_when_the_trainer_spans_nodes(ray_cluster, monkeypatch):
    from megatron_cpo.rollout.weight_sync import resolve_weight_transport

    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert resolve_weight_transport("auto") == "shm"  # one Ray node, one trainer node
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert resolve_weight_transport("auto") == "collective"  # torchrun over two nodes
    assert resolve_weight_transport("shm") == "shm"
    with pytest.raises(ValueError, match=r"weight_transport='nccl'; use one of auto, shm, collective"):
        resolve_weight_transport("nccl")
