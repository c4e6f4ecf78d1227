"""trainer/workers/offload.py on a real Megatron actor (DDP grad buffers, distributed Adam) over gloo, DP=2.

On CPU the offload target is a separate host buffer: the test offloads after one update, checks every storage of
the offloaded parts is really released (0 bytes), reloads, checks parameters, gradients and optimizer state are
bit-identical, and that one more update equals the same update of an identically built actor never offloaded. An
fp32 actor (the distributed optimizer's main parameters are views of the parameters) and a bf16 one (separate fp32
main parameters) are both run; one pair of processes runs both to pay the start-up once.
"""
import logging
from types import SimpleNamespace

import pytest
import torch

from tests.multiprocess import run_processes


def _batch():
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(2, 10, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    return StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                     scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 1.0)


def _snapshot(tensors: dict[str, list[torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
    return {part: [t.detach().clone() for t in group] for part, group in tensors.items()}


def round_trip(model_dir: str, dtype: str, *overrides: str) -> dict:
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.offload import actor_tensors, colocated_offload
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", f"actor_rollout_ref.actor.megatron.params_dtype={dtype}",
        "actor_rollout_ref.actor.megatron.param_offload=true", "actor_rollout_ref.actor.megatron.grad_offload=true",
        "actor_rollout_ref.actor.megatron.optimizer_offload=true", *overrides])
    platform.init_distributed(1, 1, seed=1)
    offloaded, _ = policies_for(config, pad_token_id=0, total_updates=10)
    plain, _ = policies_for(config, pad_token_id=0, total_updates=10)
    # built with the actor, before Adam has state: the first offload finds the moments the first step made
    offload = colocated_offload(offloaded, config.actor_rollout_ref.actor.megatron, "colocate")
    batch = _batch()

    def train(actor):  # steps 3-5 of Trainer.step, without a reference
        log_probs = compute_log_probs(batch, actor, None, policy_update_config(config), pad_token_id=0)
        advantages, metrics = compute_advantages(batch, log_probs, policy_update_config(config))
        metrics.update(update_policy(actor, batch, log_probs, advantages, policy_update_config(config)).metrics)
        return {k: v for k, v in metrics.items() if not k.startswith("timing/")}  # wall times differ

    for actor in (offloaded, plain):
        train(actor)

    tensors = actor_tensors(offloaded.model, offloaded.ddp_model, offloaded.optimizer)
    before = _snapshot(tensors)
    freed_optimizer = offload.offload(["optimizer"])  # a part alone; the others stay
    sizes = {part: offload.nbytes(part) for part in ("params", "grads", "optimizer")}
    optimizer_alone = (all(s.nbytes() == 0 for s in offload.storages("optimizer"))
                       and all(s.nbytes() > 0 for s in offload.storages("params")))
    freed_rest = offload.offload()  # the configured parts: the optimizer is already out
    released = {part: [s.nbytes() for s in offload.storages(part)] for part in sizes}
    restored = offload.reload()
    identical = {part: all(torch.equal(a, b) for a, b in zip(before[part], tensors[part])) for part in before}

    after = [train(actor) for actor in (offloaded, plain)]
    same_params = all(torch.equal(a, b) for a, b in zip(offloaded.model.parameters(), plain.model.parameters()))
    same_state = all(torch.equal(a, b) for a, b in zip(
        actor_tensors(offloaded.model, offloaded.ddp_model, offloaded.optimizer)["optimizer"],
        actor_tensors(plain.model, plain.ddp_model, plain.optimizer)["optimizer"]))
    parallel_state.destroy_model_parallel()
    return {"sizes": sizes, "freed": freed_optimizer + freed_rest, "optimizer_alone": optimizer_alone,
            "freed_optimizer": freed_optimizer, "released": released, "restored": restored, "identical": identical,
            "counts": {part: len(group) for part, group in tensors.items()}, "metrics": after,
            "same_params": same_params, "same_state": same_state,
            "param_numel": sum(p.numel() for p in offloaded.model.parameters())}


def both_dtypes(rank: int, world_size: int, model_dir: str) -> dict:
    from megatron_cpo import platform

    results = {dtype: round_trip(model_dir, dtype) for dtype in ("float32", "bfloat16")}
    platform.destroy_distributed()
    return results


def test_offload_round_trip_is_bit_identical_and_training_continues_unchanged(tiny_model_dir):
    for results in run_processes(both_dtypes, 2, str(tiny_model_dir)):
        for dtype, got in results.items():
            sizes = got["sizes"]
            numel = got["param_numel"]
            width = 4 if dtype == "float32" else 2
            # parameters live in DDP's param buffer (padded for bucketing): at least every weight's bytes
            assert sizes["params"] >= numel * width, dtype
            assert sizes["grads"] >= numel * 4, dtype  # fp32 grad buffer (grad_reduce_in_fp32)
            # Adam's two moments of this rank's shard (DP=2), plus fp32 main parameters when bf16
            shard = numel // 2
            assert sizes["optimizer"] >= shard * 4 * (2 if dtype == "float32" else 3), (dtype, sizes)
            assert sizes["optimizer"] < numel * 4 * 3, (dtype, sizes)
            assert got["optimizer_alone"] and got["freed_optimizer"] == sizes["optimizer"], dtype
            assert got["freed"] == got["restored"] == sum(sizes.values()), dtype
            assert all(n == 0 for part in got["released"].values() for n in part), dtype
            assert all(got["identical"].values()), (dtype, got["identical"])
            assert min(got["counts"].values()) > 0, dtype
            assert got["metrics"][0] == got["metrics"][1], dtype
            assert got["same_params"] and got["same_state"], dtype


def test_parts_follow_verls_switches_and_cpu_says_it_frees_nothing(caplog):
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.workers import offload as offload_module
    from megatron_cpo.trainer.workers.offload import ActorOffload, colocated_offload, configured_parts, offloaded_during

    config = build_config({}, ["actor_rollout_ref.actor.megatron.param_offload=true",
                               "actor_rollout_ref.actor.megatron.optimizer_offload=true"])
    parts = configured_parts(config.actor_rollout_ref.actor.megatron)
    assert parts == ("params", "optimizer")
    assert configured_parts(build_config({}, []).actor_rollout_ref.actor.megatron) == ()

    model = torch.nn.Linear(3, 2)  # a plain module: parameters only, no DDP buffers or optimizer
    policy = SimpleNamespace(model=model, ddp_model=None, optimizer=None)
    with caplog.at_level(logging.INFO, logger="megatron_cpo.trainer.workers.offload"):
        assert colocated_offload(policy, config.actor_rollout_ref.actor.megatron, "ray") is None
        assert colocated_offload(policy, build_config({}, []).actor_rollout_ref.actor.megatron, "colocate") is None
    assert [r.getMessage() for r in caplog.records] == [
        "actor_rollout_ref.actor.megatron.param_offload, actor_rollout_ref.actor.megatron.optimizer_offload do(es) "
        "nothing with actor_rollout_ref.rollout.mode=ray: the engines have devices of their own; models are "
        "offloaded only when colocated (mode=colocate)"]
    caplog.clear()
    assert colocated_offload(policy, config.actor_rollout_ref.actor.megatron, "colocate").parts == parts
    weight = model.weight.detach().clone()
    offload = ActorOffload(model, parts=("params",))
    offload_module._cpu_notice_logged = False
    with caplog.at_level(logging.INFO, logger="megatron_cpo.trainer.workers.offload"):
        assert offload.offload() == (6 + 2) * 4
        assert offload.offload() == 0  # already out
        assert offload.is_offloaded("params")
        assert offload.reload() == (6 + 2) * 4
        offload.offload()
        offload.reload()
    assert [r.message for r in caplog.records].count(caplog.records[0].message) == 1
    assert "does nothing useful on this platform" in caplog.records[0].message
    assert torch.equal(model.weight, weight)
    assert not offload.is_offloaded("params")  # loaded again
    with offloaded_during(offload):  # the rollout phase: out inside, back after
        assert offload.is_offloaded("params") and model.weight.untyped_storage().nbytes() == 0
    assert not offload.is_offloaded("params") and torch.equal(model.weight, weight)
    with pytest.raises(KeyError), offloaded_during(offload):
        raise KeyError("rollout failed")
    assert torch.equal(model.weight, weight)  # reloaded although the block raised
    with offloaded_during(None):
        pass  # not colocated: nothing to do
    replaced = model.weight.untyped_storage()._cdata
    model.weight = torch.nn.Parameter(torch.zeros(2, 3))  # e.g. state replaced by a checkpoint load
    offload.refresh()
    assert replaced not in [storage._cdata for storage in offload.storages("params")]  # let go, not kept alive
    assert offload.nbytes("params") == (6 + 2) * 4
    with pytest.raises(ValueError, match=r"unknown actor offload part\(s\) \['weights'\]"):
        offload.offload(["weights"])
