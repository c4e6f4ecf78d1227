"""The Megatron actor under DP=2, TP=2 and PP=2 (real Megatron-Core over gloo) gives the same update.

Two updates with GRPO advantages, a KL loss against the frozen reference and verl's KL penalty in the reward:
losses, clip fractions, gradient norms and learning rates must agree across layouts (the TP layout also scores
log-probs in other micro-batch sizes, verl's `log_prob_micro_batch_size_per_gpu`, which must not change them) (the
vocab-parallel kernel, the pipeline schedule, the data-parallel split of rows and the distributed optimizer are all on
the path). One pair of processes runs the three layouts in turn to pay the process start-up once.
"""
import pytest
import torch

from tests.multiprocess import run_processes

KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/ppo_kl", "actor/grad_norm", "actor/lr",
        "actor/pg_clipfrac", "kl", "entropy/mean", "actor/reward_kl_penalty")


def two_updates(model_dir, tp, pp, *overrides):
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.batch.step_batch import StepBatch
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        "algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.5", *overrides])
    platform.init_distributed(tp, pp, seed=1)
    actor, reference = policies_for(config, pad_token_id=0, total_updates=10)
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(2, 10, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch = StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                      scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 1.0)
    history = []
    for _ in range(2):  # steps 3-5 of Trainer.step
        log_probs = compute_log_probs(batch, actor, reference, policy_update_config(config), pad_token_id=0)
        advantages, metrics = compute_advantages(batch, log_probs, policy_update_config(config))
        history.append({**metrics,
                        **update_policy(actor, batch, log_probs, advantages, policy_update_config(config)).metrics})
    parallel_state.destroy_model_parallel()
    return [{k: m[k] for k in KEYS} for m in history]


def three_layouts(rank, world_size, model_dir):
    from megatron_cpo import platform

    micro = ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=1",
             "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4")
    results = {layout: two_updates(model_dir, *layout, *(micro if layout == (2, 1) else ()))
               for layout in ((1, 1), (2, 1), (1, 2))}
    platform.destroy_distributed()
    return results


def test_data_tensor_and_pipeline_parallel_updates_agree(tiny_model_dir):
    model_dir = str(tiny_model_dir)
    for results in run_processes(three_layouts, 2, model_dir):
        data_parallel = results[(1, 1)]
        assert data_parallel[1]["actor/kl_loss"] > 0 and data_parallel[0]["actor/grad_norm"] > 0
        # the penalty is 0 while the actor equals the reference, then the first update moves it away
        assert data_parallel[0]["actor/reward_kl_penalty"] == 0 and data_parallel[1]["actor/reward_kl_penalty"] != 0
        for layout in ((2, 1), (1, 2)):
            for expected, got in zip(data_parallel, results[layout]):
                for key in KEYS:
                    assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (layout, key)
