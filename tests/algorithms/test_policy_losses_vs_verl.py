"""Every policy-loss mode against verl's definition: the aggregated loss, its gradient with respect to the log-probs
and verl's metrics, on random batches (with empty responses, and with log-ratios beyond verl's +-20 bound) for each
of verl's aggregations (GSPO, SAPO and GMPO fix their own, as verl's do); and the config refuses what a mode does not
define.

The oracles are transcribed from verl's `compute_policy_loss_<mode>` (verl/trainer/ppo/core_algos.py, volcengine/verl
at b178a3cd, January 2026), with its `agg_loss` over the micro-batch (no global counts). One deliberate deviation is
applied to the oracle where it matters and documented in megatron_cpo/algorithms/policy_losses.py: GMPO averages
over the non-empty responses (verl's `torch.mean` also counts empty rows, which makes the loss depend on how a
batch is split into micro-batches).
"""
import dataclasses

import pytest
import torch

from megatron_cpo.algorithms.loss_config import POLICY_LOSS_MODE_RULES, PolicyLossConfig, PolicyLossModeConfig
from megatron_cpo.algorithms.losses import aggregate_loss, policy_loss
from megatron_cpo.algorithms.policy_losses import POLICY_LOSS_MODES
from megatron_cpo.config import ConfigError, build_config

SEEDS = range(6)
TOKEN_AGGREGATIONS = ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]


# ------------------------------------------------------------------ verl's losses (transcribed)


def masked_mean(values, mask):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum() / (mask.sum() + 1e-8)


def agg_loss(loss, mask, mode):
    if mode == "token-mean":
        return (torch.where(mask.bool(), loss, 0.0) * mask).sum() / mask.sum()
    seq_sum = (loss * mask).sum(-1)
    seq_mask = (mask.sum(-1) > 0).float()
    if mode == "seq-mean-token-sum":
        return (seq_sum * seq_mask).sum() / seq_mask.sum()
    return (seq_sum / (mask.sum(-1) + 1e-8) * seq_mask).sum() / seq_mask.sum()  # seq-mean-token-mean


def verl_vanilla(old, lp, adv, mask, agg, low, high, c, **_):
    nak = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(nak)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    clip1 = torch.maximum(l1, l2)
    l3 = -adv * c
    losses = torch.where(adv < 0, torch.min(l3, clip1), clip1)
    return agg_loss(losses, mask, agg), {"pg_clipfrac": masked_mean(torch.gt(l2, l1).float(), mask),
                                         "ppo_kl": masked_mean(-nak, mask),
                                         "pg_clipfrac_lower": masked_mean(torch.gt(clip1, l3).float() * (adv < 0),
                                                                          mask)}


def verl_gspo(old, lp, adv, mask, agg, low, high, **_):
    nak = lp - old
    seq = (nak * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    ratio = torch.exp(torch.clamp(lp - lp.detach() + seq.detach()[:, None], max=10.0))
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    loss = agg_loss(torch.maximum(l1, l2), mask, "seq-mean-token-mean")
    return loss, {"pg_clipfrac": masked_mean(torch.gt(l2, l1).float(), mask), "ppo_kl": masked_mean(-nak, mask),
                  "pg_clipfrac_lower": 0.0}


def verl_sapo(old, lp, adv, mask, agg, tau_pos, tau_neg, **_):
    nak = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(nak)
    taus = torch.where(adv > 0, torch.tensor(tau_pos, dtype=adv.dtype), torch.tensor(tau_neg, dtype=adv.dtype))
    gates = torch.sigmoid(taus * (ratio - 1.0)) * (4.0 / taus)
    loss = agg_loss(-gates * adv, mask, "seq-mean-token-mean")
    return loss, {"pg_clipfrac": 0.0, "ppo_kl": masked_mean(-nak, mask), "pg_clipfrac_lower": 0.0}


def verl_gpg(old, lp, adv, mask, agg, **_):
    return agg_loss(-lp * adv, mask, agg), {}


def verl_cispo(old, lp, adv, mask, agg, low, high, **_):
    nak = torch.clamp(lp - old, -20.0, 20.0)
    ratio = torch.exp(nak)
    clipped = torch.clamp(ratio, 1 - low, 1 + high)
    loss = agg_loss(-clipped.detach() * adv * lp, mask, agg)
    return loss, {"pg_clipfrac": masked_mean((ratio != clipped).float(), mask), "ppo_kl": masked_mean(-nak, mask),
                  "pg_clipfrac_lower": 0.0}


def verl_geo_mean(old, lp, adv, mask, agg, low, high, **_):
    nak = lp - old
    sign = torch.sign(adv)
    clamped = torch.clamp(nak, -low, high)
    kept = sign * torch.min(sign * nak, sign * clamped)
    lengths = mask.sum(-1)
    ratio = torch.exp((kept * mask).sum(-1) / (lengths + 1e-8))
    advantage = (adv * mask).sum(-1) / (lengths + 1e-8)
    loss = torch.mean(-advantage * ratio)
    loss = loss * len(lengths) / (lengths > 0).sum()  # deviation: the mean over the non-empty responses
    clipped = torch.ne(nak, clamped)
    return loss, {"pg_clipfrac": masked_mean((clipped * (adv > 0)).float(), mask),
                  "pg_clipfrac_lower": masked_mean((clipped * (adv < 0)).float(), mask),
                  "ppo_kl": masked_mean(-nak, mask)}


def verl_clip_cov(old, lp, adv, mask, agg, low, high, clip_cov_ratio, clip_cov_lb, clip_cov_ub, seed, **_):
    nak = lp - old
    ratio = torch.exp(nak)
    l1, l2 = -adv * ratio, -adv * torch.clamp(ratio, 1 - low, 1 + high)
    corr = torch.ones_like(adv)
    clip_by_origin = (l2 > l1) & (mask > 0)
    cov = (adv - masked_mean(adv, mask)) * (lp - masked_mean(lp.detach(), mask))
    cov[mask == 0] = -torch.inf
    cov[clip_by_origin] = -torch.inf
    clip_num = max(int(clip_cov_ratio * mask.sum().item()), 1)
    idx = torch.nonzero((cov < clip_cov_ub) & (cov > clip_cov_lb) & (mask > 0))
    torch.manual_seed(seed)
    idx = idx[torch.randperm(len(idx))[: min(clip_num, len(idx))]] if len(idx) else idx
    corr[idx[:, 0], idx[:, 1]] = 0
    loss = agg_loss(torch.maximum(l1, l2) * corr, mask, agg)
    return loss, {"pg_clipfrac": masked_mean((corr == 0).float(), mask), "ppo_kl": masked_mean(-nak, mask)}


def verl_kl_cov(old, lp, adv, mask, agg, kl_cov_ratio, ppo_kl_coef, **_):
    nak = lp - old
    ratio = torch.exp(nak)
    losses = -adv * ratio
    with_kl = -adv * ratio + ppo_kl_coef * nak.abs()
    valid = mask > 0
    valid_idx = torch.nonzero(valid.reshape(-1), as_tuple=True)[0]
    valid_adv, valid_lp = adv[valid].detach().reshape(-1), lp[valid].detach().reshape(-1)
    cov = (valid_adv - valid_adv.mean()) * (valid_lp - valid_lp.mean())
    k = max(1, int(len(cov) * kl_cov_ratio))
    large = valid_idx[torch.topk(cov, k, largest=True).indices]
    width = adv.shape[1]
    losses = losses.clone()
    losses[large // width, large % width] = with_kl[large // width, large % width]
    return agg_loss(losses, mask, agg), {"ppo_kl": masked_mean(nak.abs(), mask)}


ORACLES = {"vanilla": verl_vanilla, "gspo": verl_gspo, "sapo": verl_sapo, "gpg": verl_gpg, "cispo": verl_cispo,
           "geo_mean": verl_geo_mean,
           "clip_cov": verl_clip_cov, "kl_cov": verl_kl_cov}
SETTINGS = {
    "vanilla": [dict(low=0.2, high=0.28, c=3.0), dict(low=0.1, high=0.1, c=1.5)],
    "gspo": [dict(low=3e-4, high=4e-4), dict(low=0.05, high=0.08)],
    "sapo": [dict(tau_pos=1.0, tau_neg=1.05), dict(tau_pos=2.0, tau_neg=4.0)],
    "gpg": [dict()],
    "cispo": [dict(low=10.0, high=0.2), dict(low=0.2, high=0.28)],
    "geo_mean": [dict(low=0.4, high=0.4), dict(low=0.1, high=0.2)],
    "clip_cov": [dict(low=0.2, high=0.2, clip_cov_ratio=0.2, clip_cov_lb=0.2, clip_cov_ub=5.0),
                 dict(low=0.1, high=0.3, clip_cov_ratio=0.0002, clip_cov_lb=-1.0, clip_cov_ub=1.0)],
    "kl_cov": [dict(kl_cov_ratio=0.2, ppo_kl_coef=0.1), dict(kl_cov_ratio=0.0002, ppo_kl_coef=1.0)],
}


# ------------------------------------------------------------------ the tests


def random_batch(seed: int, n: int = 6, width: int = 8, spread: float = 0.3):
    """Log-probs `spread` (standard deviation of the log-ratio) from the old ones; 25 puts 40% of the log-ratios
    beyond verl's +-20 bound."""
    gen = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(n, width, generator=gen, dtype=torch.float64)
    log_probs = old + spread * torch.randn(n, width, generator=gen, dtype=torch.float64)
    per_response = torch.randn(n, 1, generator=gen, dtype=torch.float64)
    advantages = per_response + 0.5 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    return log_probs, old, advantages, mask


def config_for(mode: str, agg: str, settings: dict) -> PolicyLossConfig:
    loss = {k: settings[k] for k in ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "kl_cov_ratio", "ppo_kl_coef")
            if k in settings}
    extra = {k: settings[k] for k in ("tau_pos", "tau_neg") if k in settings}
    return PolicyLossConfig(policy_loss=PolicyLossModeConfig(loss_mode=mode, **loss), loss_agg_mode=agg,
                            clip_ratio_low=settings.get("low", 0.2), clip_ratio_high=settings.get("high", 0.2),
                            clip_ratio_c=settings.get("c", 3.0), **extra)


CASES = [(mode, agg, index) for mode in ORACLES for agg in TOKEN_AGGREGATIONS for index in range(len(SETTINGS[mode]))]


@pytest.mark.parametrize("spread", [0.3, 25.0])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode, agg, setting", CASES)
def test_mode_equals_verl_in_loss_gradient_and_metrics(seed, mode, agg, setting, spread):
    settings = SETTINGS[mode][setting]
    log_probs, old, advantages, mask = random_batch(seed, spread=spread)
    if spread > 1:
        assert ((log_probs - old).abs()[mask.bool()] > 20).any()  # verl's bound is reached
    ours_lp = log_probs.clone().requires_grad_()
    loss, metrics = policy_loss(ours_lp, old, advantages, mask, config_for(mode, agg, settings),
                                generator=torch.Generator().manual_seed(seed))
    loss.backward()
    verl_lp = log_probs.clone().requires_grad_()
    expected, expected_metrics = ORACLES[mode](old, verl_lp, advantages, mask, agg, seed=seed, **settings)
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    valid = mask.bool()
    torch.testing.assert_close(ours_lp.grad[valid], verl_lp.grad[valid], rtol=1e-6, atol=1e-9)
    assert not ours_lp.grad[~valid].any()
    for key, value in expected_metrics.items():
        expected_value = float(torch.as_tensor(value).detach())
        assert metrics[key] == pytest.approx(expected_value, rel=1e-6, abs=1e-7), key  # metrics: float32 means


def test_the_modes_actually_clip_select_and_penalise():
    """The random batches reach each mode's special branch (else the equality above would prove little)."""
    log_probs, old, advantages, mask = random_batch(0)
    for mode, key in (("gspo", "pg_clipfrac"), ("cispo", "pg_clipfrac"), ("geo_mean", "pg_clipfrac"),
                      ("clip_cov", "pg_clipfrac")):
        _, metrics = policy_loss(log_probs, old, advantages, mask, config_for(mode, "seq-mean-token-mean",
                                                                               SETTINGS[mode][0]),
                                 generator=torch.Generator().manual_seed(0))
        assert metrics[key] > 0, mode
    plain, _ = policy_loss(log_probs, old, advantages, mask, config_for("kl_cov", "token-mean",
                                                                         dict(kl_cov_ratio=0.2, ppo_kl_coef=0.0)))
    penalised, _ = policy_loss(log_probs, old, advantages, mask, config_for("kl_cov", "token-mean",
                                                                             SETTINGS["kl_cov"][0]))
    assert float(penalised) > float(plain)


@pytest.mark.parametrize("mode", sorted(POLICY_LOSS_MODES))
def test_nan_on_padding_reaches_neither_loss_nor_gradient(mode):
    log_probs, old, advantages, mask = random_batch(1)
    padding = ~mask.bool()
    old, advantages = old.masked_fill(padding, float("nan")), advantages.masked_fill(padding, float("nan"))
    log_probs = log_probs.clone().requires_grad_()
    settings = {**SETTINGS.get(mode, [{}])[0]}
    agg = "token-mean" if mode == "vanilla" else "seq-mean-token-sum-norm"
    loss, metrics = policy_loss(log_probs, old, advantages, mask, config_for(mode, agg, settings),
                                generator=torch.Generator().manual_seed(0))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(log_probs.grad).all(), mode
    assert all(value == value for value in metrics.values()), metrics


def test_on_policy_ratio_gives_the_plain_policy_gradient():
    """With old = current (one update per batch) these modes reduce to -A grad log pi per token (Clip-Cov still
    detaches its chosen tokens; GSPO, SAPO and GMPO weight per sequence)."""
    log_probs, _, advantages, mask = random_batch(2)
    expected = -torch.where(mask.bool(), advantages, 0.0)
    for mode in ("vanilla", "cispo", "gpg", "kl_cov"):
        lp = log_probs.clone().requires_grad_()
        loss, _ = policy_loss(lp, lp.detach(), advantages, mask, config_for(mode, "token-sum", {}),
                              generator=torch.Generator().manual_seed(0))
        loss.backward()
        torch.testing.assert_close(lp.grad, expected, msg=mode)


def test_ppo_kl_is_the_mean_of_the_bounded_log_ratio_where_verl_bounds_it():
    """Old log-probs [-1, -1], new [24, -1]: the log-ratios 25 and 0 average to 12.5, and to 10 once bounded to 20,
    which vanilla, SAPO and CISPO do before verl's ppo_kl (GSPO, GMPO and Clip-Cov do not bound it)."""
    old, new = torch.tensor([[-1.0, -1.0]]), torch.tensor([[24.0, -1.0]])
    advantages, mask = torch.tensor([[1.0, 1.0]]), torch.ones(1, 2)
    for mode, expected in (("vanilla", -10.0), ("sapo", -10.0), ("cispo", -10.0), ("gspo", -12.5),
                           ("geo_mean", -12.5), ("clip_cov", -12.5)):
        _, metrics = policy_loss(new, old, advantages, mask, config_for(mode, "seq-mean-token-mean", {}),
                                 generator=torch.Generator().manual_seed(0))
        assert metrics["ppo_kl"] == pytest.approx(expected), mode


@pytest.mark.parametrize("mode", ["gspo", "sapo", "geo_mean"])
@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-sum-norm"])
def test_sequence_modes_aggregate_their_own_way_and_entropy_and_kl_follow_loss_agg_mode(mode, agg, caplog):
    """As verl: the policy-gradient term of GSPO, SAPO and GMPO is the same whatever `loss_agg_mode` says, and the
    entropy bonus and KL loss use `loss_agg_mode`; one log line says which aggregation the term has."""
    from megatron_cpo.algorithms import losses

    log_probs, old, advantages, mask = random_batch(3)
    entropy = torch.rand(log_probs.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref = old - 0.1
    settings = {**SETTINGS[mode][0]}
    extra = dict(entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    given = dataclasses.replace(config_for(mode, agg, settings), **extra)
    sequence = dataclasses.replace(config_for(mode, "seq-mean-token-mean", settings), **extra)
    losses._announce.cache_clear()
    with caplog.at_level("INFO", logger=losses.__name__):
        ours, metrics = policy_loss(log_probs, old, advantages, mask, given, entropy=entropy, ref_log_probs=ref)
        policy_loss(log_probs, old, advantages, mask, given, entropy=entropy, ref_log_probs=ref)
    _, reference = policy_loss(log_probs, old, advantages, mask, sequence, entropy=entropy, ref_log_probs=ref)
    assert metrics["pg_loss"] == pytest.approx(reference["pg_loss"], rel=1e-12)
    assert metrics["entropy"] == pytest.approx(float(aggregate_loss(entropy, mask, agg)), rel=1e-12)
    assert metrics["entropy"] != pytest.approx(reference["entropy"], rel=1e-6)
    assert float(ours) == pytest.approx(metrics["pg_loss"] - 0.01 * metrics["entropy"] + 0.1 * metrics["kl_loss"])
    notes = [r.getMessage() for r in caplog.records if "aggregates its policy-gradient term" in r.getMessage()]
    assert notes == [f"policy_loss.loss_mode={mode} aggregates its policy-gradient term with seq-mean-token-mean, "
                     f"as verl does whatever loss_agg_mode says; the entropy and KL-loss terms use "
                     f"actor_rollout_ref.actor.loss_agg_mode={agg}"]


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.actor.policy_loss.loss_mode=ppo"], "policy_loss.loss_mode='ppo' is not supported; choose one"),
    (["actor_rollout_ref.actor.clip_ratio_low=10"], "clip_ratio_low=10.0 must be in [0, 1) (the ratio's lower clip"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_lb=6"],
     "clip_cov_lb=6.0 must be below clip_cov_ub=5.0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "actor_rollout_ref.actor.policy_loss.kl_cov_ratio=0"],
     "kl_cov_ratio=0.0 must be > 0"),
    (["actor_rollout_ref.actor.policy_loss.loss_mode=sapo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
      "actor_rollout_ref.actor.tau_neg=0"], "actor_rollout_ref.actor.tau_neg=0.0 must be > 0"),
])
def test_what_a_mode_does_not_define_is_refused_at_load(overrides, message):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert message in str(err.value)


@pytest.mark.parametrize("mode", ["gspo", "sapo", "geo_mean"])
def test_the_sequence_modes_load_with_verls_token_mean(mode):
    """verl's GSPO script sets loss_agg_mode=token-mean, which verl's GSPO (and SAPO, GMPO) ignore."""
    actor = build_config({}, [f"actor_rollout_ref.actor.policy_loss.loss_mode={mode}",
                              "actor_rollout_ref.actor.loss_agg_mode=token-mean"]).actor_rollout_ref.actor
    assert (actor.loss_agg_mode, actor.policy_aggregation) == ("token-mean", "seq-mean-token-mean")
    assert "seq-mean-token-mean" in actor.aggregation_note()


def test_verls_keys_load_and_cispo_takes_an_open_lower_clip():
    config = build_config({}, ["actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
                               "actor_rollout_ref.actor.clip_ratio_low=10",
                               "actor_rollout_ref.actor.clip_ratio_high=0.2"])
    actor = config.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.clip_ratio_low) == ("cispo", 10.0)
    gspo = build_config({}, ["actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
                             "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
                             "actor_rollout_ref.actor.clip_ratio_low=3e-4",
                             "actor_rollout_ref.actor.clip_ratio_high=4e-4"])
    assert gspo.actor_rollout_ref.actor.policy_loss.rules is POLICY_LOSS_MODE_RULES["gspo"]
