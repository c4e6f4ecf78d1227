"""The on-policy update takes its old log-probs from its own forward
(`policy_update.old_log_probs_from_update`): the same update as a separate scoring pass first, one forward cheaper;
CPO's shaping then runs inside the update on each micro-batch from that forward (trainer/workers/shaping.py) and
trains on the advantages the separate pass + whole-batch shaping gives; and a bf16 actor trains with fp32 master
weights.

Real Megatron on gloo (two spawned ranks: DP=2, then PP=2), the suite's tiny model. In each layout two identically
built fp32 actors train on the same batch, one through the separate old-log-prob pass, one through
`update_on_policy`: their weights after the update, the loss terms, the old log-probs / entropy and the advantages
the step reports it trained on (gathered over DP, broadcast from the last pipeline stage) must agree, and the step's
earlier values stay as they were.
"""
import torch

from tests.multiprocess import run_processes


def _batch(hints: bool = False):
    """Two mixed prompts of four responses; with `hints`, the wrong responses (those `mi3` can change through a
    hint) carry a hinted prompt, and the batch kept half of its groups (loss scaling applies after the shaping)."""
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(2, 12, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0])
    wrong = scores == 0
    extra = dict(hint_prompt_ids=[[1, 20, 21, 22, 23, 24, 5, 6, 7, 8]] * 2 + [[1, 25, 26, 27, 9, 10, 11]] * 2,
                 has_hint=wrong) if hints else {}
    return StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                     scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool),
                     0.5 if hints else 1.0, **extra)


def _train(rank, world_size, model_dir):
    from megatron_cpo import platform

    results = {"dp2": _compare(model_dir, pp=1), "pp2": _compare(model_dir, pp=2),
               "cpo_dp2": _compare(model_dir, pp=1, cpo=True)}
    platform.destroy_distributed()
    return results


def _compare(model_dir, pp, cpo=False):
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers import policy_update

    overrides = [f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2",
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                 "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.entropy_coeff=0.01",
                 f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"]
    if cpo:  # pos_alpha 1 and neg_alpha 2 move the advantages far enough to show in the update
        overrides += ["algorithm.adv_estimator=cpo", "algorithm.cpo.wrap_method=mi3", "algorithm.cpo.pos_alpha=1.0",
                      "algorithm.cpo.neg_alpha=2.0", "actor_rollout_ref.actor.filter_loss_scaling=sqrt"]
    config = build_config({}, overrides)
    settings = policy_update_config(config)
    assert policy_update.old_log_probs_from_update(settings)
    platform.init_distributed(1, pp, seed=1)
    batch, results = _batch(hints=cpo), {}
    for mode in ("separate_pass", "from_update"):
        actor, _ = policies_for(config, pad_token_id=0, total_updates=4)
        if mode == "separate_pass":  # what the trainer did before the predicate existed
            seqs = policy_update.prepare_sequences(batch, 0, config.data.max_response_length)[0]
            old, entropy = actor.log_probs(seqs, 1.0)
            lp = policy_update.compute_log_probs(batch, actor, None, settings, pad_token_id=0)
            lp = policy_update.BatchLogProbs(lp.seqs, lp.mask, lp.rollout_log_probs, old, entropy, None,
                                             lp.hint_log_probs)
        else:
            lp = policy_update.compute_log_probs(batch, actor, None, settings, pad_token_id=0)
            assert lp.old_log_probs is None and lp.entropy is None and "timing/old_log_prob_s" not in lp.timing
        advantages, metrics = policy_update.compute_advantages(batch, lp, settings)
        assert (advantages.shaped is None) == (cpo and mode == "from_update")  # then the update shapes them
        estimated = advantages.estimated.clone()
        update = policy_update.update_policy(actor, batch, lp, advantages, settings)
        metrics.update(update.metrics)
        # the update returned what it computed: steps 3-4's values are as they were
        assert (lp.old_log_probs is None) == (mode == "from_update") and torch.equal(advantages.estimated, estimated)
        if cpo:  # only the wrong responses were scored under their hints; the shaping moved the advantages
            assert lp.hint_log_probs[~batch.has_hint].eq(0).all() and lp.hint_log_probs[batch.has_hint].ne(0).any()
            assert metrics["cpo/hinted_frac"] == 0.5 and metrics["cpo/shaped_token_frac"] > 0
            assert metrics["filter/loss_scale"] == 0.5 ** 0.5
            assert not torch.equal(update.advantages, estimated)
        results[mode] = {"params": torch.cat([p.detach().reshape(-1).clone() for p in actor.model.parameters()]),
                         "old_log_probs": update.old_log_probs, "entropy": update.entropy,
                         "advantages": update.advantages, "metrics": metrics}

    parameters = torch.cat([p.detach().reshape(-1) for p in actor.model.parameters()])  # this stage's
    if pp == 1 and not cpo:  # the bf16 actor, at DP=2
        bf16 = build_config({}, overrides + ["actor_rollout_ref.actor.megatron.params_dtype=bfloat16"])
        results["bf16"] = _bf16_update(bf16, batch)
    parallel_state.destroy_model_parallel()
    separate, from_update = results.pop("separate_pass"), results.pop("from_update")  # plain numbers cross the queue
    results["differences"] = {key: float((from_update[key] - separate[key]).abs().max())
                              for key in ("params", "old_log_probs", "entropy", "advantages")}
    results["params_scale"] = float(parameters.abs().max())
    results["metric_differences"] = {key: abs(from_update["metrics"][key] - separate["metrics"][key]) for key in (
        "actor/pg_loss", "actor/entropy", "actor/grad_norm", "entropy/mean", "completions/mean_length",
        "advantages/mean", "advantages/abs_mean") + (("cpo/adv_change_mean", "cpo/mi_mean") if cpo else ())}
    results["update_seconds"] = from_update["metrics"]["timing/update_actor_s"]
    return results


def _bf16_update(bf16_config, batch):
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers import policy_update

    actor, _ = policies_for(bf16_config, pad_token_id=0, total_updates=4)
    before = [p.detach().float().clone() for p in actor.model.parameters()]
    settings = policy_update_config(bf16_config)
    lp = policy_update.compute_log_probs(batch, actor, None, settings, pad_token_id=0)
    advantages = policy_update.compute_advantages(batch, lp, settings)[0]
    update = policy_update.update_policy(actor, batch, lp, advantages, settings)
    # what Adam updates: the main parameters (with the distributed optimizer, this rank's shard of them)
    masters = [p for member in actor.optimizer.chained_optimizers for group in member.optimizer.param_groups
               for p in group["params"]]
    return {"param_dtypes": sorted({str(p.dtype) for p in actor.model.parameters()}),
            "master_dtypes": sorted({str(p.dtype) for p in masters}), "master_numel": sum(p.numel() for p in masters),
            "numel": sum(p.numel() for p in actor.model.parameters()),
            "moved": max(float((p.float() - b).abs().max()) for p, b in zip(actor.model.parameters(), before)),
            "old_log_probs_finite": bool(torch.isfinite(update.old_log_probs).all())}


def test_on_policy_update_equals_the_separate_pass_and_bf16_keeps_fp32_masters(tiny_model_dir):
    ranks = run_processes(_train, 2, str(tiny_model_dir))
    for rank_results in ranks:
        for layout in ("dp2", "pp2", "cpo_dp2"):
            results = rank_results[layout]
            assert results["differences"]["old_log_probs"] < 1e-5 and results["differences"]["entropy"] < 1e-5
            # what the on-policy update trained on (CPO: shaped micro-batch by micro-batch from its own forward) is
            # the whole-batch shaping of the separate pass's log-probs
            assert results["differences"]["advantages"] < 1e-5, layout
            assert results["differences"]["params"] < 1e-6 and results["params_scale"] > 0, layout
            assert all(value < 1e-5 for value in results["metric_differences"].values()), (layout, results)
            assert results["update_seconds"] > 0
        bf16 = rank_results["dp2"]["bf16"]
        assert bf16["param_dtypes"] == ["torch.bfloat16"] and bf16["master_dtypes"] == ["torch.float32"]
        assert bf16["moved"] > 0 and bf16["old_log_probs_finite"]
    # the distributed optimizer's fp32 main weights: each DP rank holds a shard, together all of them
    master_numel = sum(rank_results["dp2"]["bf16"]["master_numel"] for rank_results in ranks)
    assert master_numel == ranks[0]["dp2"]["bf16"]["numel"]


def test_old_log_probs_come_from_the_update_only_when_it_is_exactly_on_policy():
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policy_update_config
    from megatron_cpo.trainer.workers.policy_update import old_log_probs_from_update

    def from_update(overrides):
        return old_log_probs_from_update(policy_update_config(build_config({}, overrides)))

    base = ["data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=8"]
    assert from_update(base)
    assert not from_update(base + ["actor_rollout_ref.actor.ppo_epochs=2"])
    assert not from_update(base + ["actor_rollout_ref.actor.ppo_mini_batch_size=4"])
    assert not from_update(base + ["algorithm.use_kl_in_reward=true"])
    assert from_update(base + ["algorithm.adv_estimator=cpo"])  # CPO shapes inside the update, from its forward
    assert from_update(base + ["algorithm.filter_groups.enable=true"])
    # routing replay R2 records each token's experts in the separate pass for the update to replay
    assert not from_update(base + ["actor_rollout_ref.actor.router_replay.mode=R2"])
