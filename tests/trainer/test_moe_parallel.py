"""A mixture of experts in the trainer (tiny Qwen3-MoE: 4 layers, two of them MoE with 4 experts, top-2), on two real
gloo ranks running Megatron-Core. One pair of processes runs every case in turn (the start-up is paid once):

- expert parallelism: EP=2 (two experts per rank) equals EP=1 (both DP=2) for both token dispatchers: the old
  log-probs, the update's loss, its gradients (every expert's, gathered under their HF names, with the plain
  optimizer) and, with the distributed optimizer, the gradient norm and the updated weights (the expert-data-parallel
  groups differ between the two layouts);
- routing replay (R2): with the routers changed between the old-log-prob pass and the update, the update's top-k
  equals the recorded one with replay and differs without it, also when the update cuts and packs the rows
  differently from the old pass and under TP=2 with sequence parallelism; replaying a routing the weights would
  choose anyway gives the gradients of the run without replay;
- the auxiliary losses reach the gradients (of the routers and what feeds them) and are logged; a frozen
  router stays as loaded.
"""
import pytest
import torch

from tests.multiprocess import run_processes

TOLERANCE = 1e-5
LR = 1e-2


def _batch(scores):
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(4, 12, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    return StepBatch([[1, 5, 6, 7, 8, 9]] * 4 + [[1, 9, 10, 11]] * 4, responses,
                     [[-4.0] * len(r) for r in responses], scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]),
                     torch.zeros(8, dtype=torch.bool), 1.0)


def _exported(model, grads: bool) -> dict[str, torch.Tensor]:
    """The model's weights, or its reduced gradients (`main_grad`, zeros where frozen), under HF names (experts
    gathered over EP); collective, filled on rank 0."""
    from megatron_cpo.models import iter_hf_weights

    saved = {}
    if grads:
        for param in model.parameters():
            saved[param] = param.data
            grad = getattr(param, "main_grad", None)
            param.data = grad.to(param.dtype) if grad is not None else torch.zeros_like(param)
    try:
        return {name: tensor.detach().clone() for name, tensor in iter_hf_weights(model, model.hf_config)}
    finally:
        for param, data in saved.items():
            param.data = data


def run_case(model_dir, tp=1, ep=1, *overrides, scores=(1.0, 0, 0, 1, 0, 1, 1, 1), perturb_routers=False,
             export=None):
    """One step's log-probs and update on `model_dir` at TP x EP (2 ranks); returns the log-probs, the metrics and
    (`export`: "grads" / "weights") the model's exported tensors after the update."""
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy
    from megatron_cpo.trainer.workers.routing import moe_routers

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        f"actor_rollout_ref.actor.optim.lr={LR}", "actor_rollout_ref.actor.optim.clip_grad=1e9",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.sequence_parallel={tp > 1}",
        f"actor_rollout_ref.actor.megatron.expert_model_parallel_size={ep}",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1", *overrides])
    platform.init_distributed(tp, 1, seed=1, expert_model_parallel_size=ep, expert_tensor_parallel_size=1)
    actor, _ = policies_for(config, pad_token_id=0, total_updates=10)
    routers_before = [router.weight.detach().clone() for router in moe_routers(actor.model)]
    local_experts = sum(name.startswith("decoder.layers.1.mlp.experts.local_experts.") and "linear_fc1" in name
                        for name, _ in actor.model.named_parameters())  # this rank's experts of MoE layer 1
    batch = _batch(torch.tensor(scores))
    log_probs = compute_log_probs(batch, actor, None, policy_update_config(config), pad_token_id=0)
    if perturb_routers:  # the same change on every rank: the update would route many tokens elsewhere
        generator = torch.Generator().manual_seed(7)
        with torch.no_grad():
            for router in moe_routers(actor.model):
                router.weight.add_(torch.randn(router.weight.shape, generator=generator))
    advantages, metrics = compute_advantages(batch, log_probs, policy_update_config(config))
    metrics.update(update_policy(actor, batch, log_probs, advantages, policy_update_config(config)).metrics)
    exported = _exported(actor.model, export == "grads") if export else None
    routers_moved = [not torch.equal(before, router.weight)
                     for before, router in zip(routers_before, moe_routers(actor.model))]
    parallel_state.destroy_model_parallel()
    return {"log_probs": log_probs.old_log_probs, "metrics": metrics, "exported": exported,
            "routers_moved": routers_moved, "local_experts": local_experts}


def all_cases(rank, world_size, model_dir):
    from megatron_cpo import platform

    torch.set_num_threads(1)
    single = ("actor_rollout_ref.actor.ppo_mini_batch_size=2",)  # one update, with the weights that routed the pass
    import time
    started = time.perf_counter()
    results = {
        "ep1/grads": run_case(model_dir, 1, 1, "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
                              export="grads"),
        "ep1/weights": run_case(model_dir, 1, 1, export="weights"),
        "replay/plain": run_case(model_dir, 1, 2, "actor_rollout_ref.actor.router_replay.mode=R2", *single,
                                 "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false", export="grads"),
        "no_replay/plain": run_case(model_dir, 1, 2, *single,
                                    "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
                                    export="grads"),
        "replay/perturbed": run_case(model_dir, 1, 2, "actor_rollout_ref.actor.router_replay.mode=R2",
                                     "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
                                     "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                                     "actor_rollout_ref.model.use_remove_padding=true", perturb_routers=True),
        "no_replay/perturbed": run_case(model_dir, 1, 2, perturb_routers=True),
        "replay/tp2_sp": run_case(model_dir, 2, 2, "actor_rollout_ref.actor.router_replay.mode=R2",
                                  perturb_routers=True),
        "aux_losses": run_case(
            model_dir, 1, 2,
            "actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_load_balancing_type=aux_loss",
            "actor_rollout_ref.actor.megatron.override_transformer_config.moe_aux_loss_coeff=0.01",
            "actor_rollout_ref.actor.megatron.override_transformer_config.moe_z_loss_coeff=0.001",
            "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false", scores=(1.0,) * 8, export="grads"),
        "frozen": run_case(model_dir, 1, 2, "actor_rollout_ref.actor.megatron.freeze_moe_router=true"),
    }
    for dispatcher in ("allgather", "alltoall"):
        setting = f"actor_rollout_ref.actor.megatron.override_transformer_config.moe_token_dispatcher_type={dispatcher}"
        results[f"ep2/{dispatcher}/grads"] = run_case(
            model_dir, 1, 2, setting, "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
            export="grads")
        results[f"ep2/{dispatcher}/weights"] = run_case(model_dir, 1, 2, setting, export="weights")
    platform.destroy_distributed()
    print(f"rank {rank}: all cases in {time.perf_counter() - started:.1f} s", flush=True)
    return _plain(results)


def _plain(value):
    """Tensors as numpy arrays: torch would pass them through shared memory, which dies with the rank process."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value.numpy() if isinstance(value, torch.Tensor) else value


def _max_difference(expected: dict, got: dict) -> float:
    assert sorted(expected) == sorted(got)
    return max(float(abs(expected[name] - got[name]).max()) for name in expected)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    from megatron_cpo.models.tiny import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("moe") / "tiny-qwen3-moe", family="qwen3_moe", seed=0)
    return run_processes(all_cases, 2, str(model_dir))


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_expert_parallel_training_equals_ep1(results, dispatcher):
    lead = results[0]
    for kind in ("grads", "weights"):
        single, split = lead[f"ep1/{kind}"], lead[f"ep2/{dispatcher}/{kind}"]
        assert abs(single["log_probs"] - split["log_probs"]).max() <= TOLERANCE
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "moe/expert_load_max_over_mean",
                    "moe/router_entropy"):
            assert split["metrics"][key] == pytest.approx(single["metrics"][key], rel=TOLERANCE, abs=TOLERANCE), key
        assert (single["local_experts"], split["local_experts"]) == (4, 2)  # EP=2: two experts per rank
        assert any("experts.3." in name for name in split["exported"])  # rank 1's experts, gathered
        # Adam's first steps are about lr x sign(gradient): float noise in tiny gradients moves a weight by a
        # fraction of a step; a sharding error of the optimizer would move it by whole steps (lr = 1e-2)
        bound = TOLERANCE if kind == "grads" else 1e-2 * LR
        assert _max_difference(single["exported"], split["exported"]) <= bound, kind
    assert single["metrics"]["actor/grad_norm"] > 0


def test_replayed_routing_is_the_recorded_one_and_trains_like_unreplayed_routing(results):
    lead = results[0]
    # the routers moved between the passes: without replay the update routes a share of tokens elsewhere
    assert lead["no_replay/perturbed"]["metrics"]["moe/topk_changed_fraction"] > 0.05
    for case in ("replay/perturbed", "replay/tp2_sp"):  # other micro-batches and packed rows; TP=2 with SP
        assert lead[case]["metrics"]["moe/topk_changed_fraction"] == 0, case
    # weights that route every token as recorded: replaying changes nothing, gradients included
    plain, replayed = lead["no_replay/plain"], lead["replay/plain"]
    assert plain["metrics"]["moe/topk_changed_fraction"] == 0
    assert _max_difference(plain["exported"], replayed["exported"]) <= 1e-6
    assert replayed["metrics"]["actor/grad_norm"] == pytest.approx(plain["metrics"]["actor/grad_norm"], rel=1e-6)


def test_auxiliary_losses_reach_the_gradients_and_are_logged(results):
    aux = results[0]["aux_losses"]
    assert aux["metrics"]["actor/pg_loss"] == 0  # every score equal: no advantage, no policy gradient
    assert aux["metrics"]["actor/moe_load_balancing_loss"] > 0 and aux["metrics"]["actor/moe_z_loss"] > 0
    grads = {name: abs(grad).max() for name, grad in aux["exported"].items()}
    # the routers' losses train the routers and everything below them, nothing above the last MoE layer
    assert grads["model.layers.3.mlp.gate.weight"] > 0 and grads["model.layers.0.self_attn.q_proj.weight"] > 0
    assert grads["lm_head.weight"] == 0 and grads["model.norm.weight"] == 0
    assert "actor/moe_load_balancing_loss" not in results[0]["ep1/grads"]["metrics"]


def test_a_frozen_router_keeps_its_weights(results):
    lead = results[0]
    assert lead["frozen"]["routers_moved"] == [False, False]
    assert lead["ep2/alltoall/weights"]["routers_moved"] == [True, True]
    assert lead["frozen"]["metrics"]["actor/grad_norm"] > 0  # the rest of the model trains
