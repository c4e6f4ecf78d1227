"""Every policy-loss mode trains the real Megatron actor: the suite's tiny model in this process (one gloo rank), and
for each mode an actor built from it runs the trainer's own `compute_log_probs` / `compute_advantages` /
`update_policy` on the same batch, twice. The first update is on-policy (ratio 1): the `actor/pg_loss` it reports is
the mode's loss (algorithms/losses.py) of the whole batch, recomputed here from the log-probs the update returned.
The second reuses those old log-probs after the weights moved, so the ratio leaves 1 and the modes clip and select
(GSPO's sequence ratios leave 1 +- 4e-4)."""
import dataclasses

import pytest
import torch

from megatron_cpo.algorithms.loss_config import PolicyLossModeConfig
from megatron_cpo.algorithms.policy_losses import POLICY_LOSS_MODES

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("restore_environment")]

MODE_SETTINGS = {
    "vanilla": {},
    "gspo": {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"},
    "sapo": {"loss_agg_mode": "seq-mean-token-mean"},
    "cispo": {"clip_ratio_low": 10.0},
    "geo_mean": {"clip_ratio_low": 0.4, "clip_ratio_high": 0.4, "loss_agg_mode": "seq-mean-token-mean"},
    "gpg": {},
    "clip_cov": {"policy_loss": {"clip_cov_ratio": 0.2, "clip_cov_lb": -5.0}},
    "kl_cov": {"policy_loss": {"kl_cov_ratio": 0.2}},
}


def _batch():
    from megatron_cpo.trainer.batch.step_batch import StepBatch

    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 100, (int(torch.randint(2, 12, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 0])
    return StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                     scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 1.0)


def _with_mode(config, mode):
    """`config` with the mode's loss settings (the actor section is rebuilt, so its checks run again)."""
    settings = dict(MODE_SETTINGS[mode])
    loss = PolicyLossModeConfig(loss_mode=mode, **settings.pop("policy_loss", {}))
    actor = dataclasses.replace(config.actor_rollout_ref.actor, policy_loss=loss, **settings)
    return dataclasses.replace(config, actor_rollout_ref=dataclasses.replace(config.actor_rollout_ref, actor=actor))


def test_every_loss_mode_updates_the_megatron_actor(tiny_model_dir):
    from megatron_cpo import platform
    from megatron_cpo.algorithms.losses import policy_loss
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers import policy_update

    assert set(MODE_SETTINGS) == set(POLICY_LOSS_MODES)
    base = build_config({}, [f"actor_rollout_ref.model.path={tiny_model_dir}", "data.train_batch_size=2",
                             "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                             "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3",
                             "actor_rollout_ref.actor.optim.lr=1e-2"])
    platform.init_distributed(1, 1, seed=1)
    batch, results = _batch(), {}
    try:
        for mode in MODE_SETTINGS:
            config = _with_mode(base, mode)
            settings = policy_update_config(config)
            actor, _ = policies_for(config, pad_token_id=0, total_updates=2)
            start = [p.detach().clone() for p in actor.model.parameters()]
            lp = policy_update.compute_log_probs(batch, actor, None, settings, pad_token_id=0)
            advantages, _ = policy_update.compute_advantages(batch, lp, settings)
            first = policy_update.update_policy(actor, batch, lp, advantages, settings)  # its own old log-probs
            expected, _ = policy_loss(first.old_log_probs, first.old_log_probs, first.advantages, lp.mask,
                                      config.actor_rollout_ref.actor, generator=torch.Generator().manual_seed(0))
            reused = dataclasses.replace(lp, old_log_probs=first.old_log_probs, entropy=first.entropy)
            first, second = first.metrics, policy_update.update_policy(actor, batch, reused, advantages,
                                                                       settings).metrics
            moved = max(float((p.detach() - s).abs().max()) for p, s in zip(actor.model.parameters(), start))
            results[mode] = (first, second, float(expected), moved)
    finally:
        platform.destroy_distributed()
    for mode, (first, second, expected, moved) in results.items():
        for metrics in (first, second):
            assert metrics["actor/update_skipped"] == 0, mode
            assert all(value == value for value in metrics.values()), (mode, metrics)  # no NaN
        assert first["actor/grad_norm"] > 0, mode
        assert second["actor/grad_norm"] > 0 or second["actor/pg_clipfrac"] == 1, mode  # all clipped: no gradient
        assert moved > 0, mode
        if mode != "clip_cov":  # Clip-Cov's random tokens come from the actor's own stream
            assert first["actor/pg_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6), mode
    assert results["gspo"][1]["actor/pg_clipfrac"] > 0 and results["gspo"][0]["actor/pg_clipfrac"] == 0
    assert results["cispo"][1]["actor/ppo_kl"] != 0
    losses = {mode: round(result[1]["actor/pg_loss"], 6) for mode, result in results.items()}
    assert len(set(losses.values())) == len(losses), losses  # each mode computed its own objective
