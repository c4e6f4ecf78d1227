"""On-policy distillation's signal against verl's and slime's code: every loss mode's per-token divergence, the
policy-gradient and loss forms with every aggregation, the combination with the task loss, verl's metrics and the
gradients, on random float64 batches with an empty response, at extreme log-probs and with the clamps; teacher =
student gives no signal; slime's additive form against slime's function.

The oracles are transcribed from verl-project/verl at 1dda039b (2026-08-22): `kl_penalty_forward`, `agg_loss` and
`compute_policy_loss_vanilla` (verl/trainer/ppo/core_algos.py), `distillation_ppo_loss`, `distillation_loss`,
`compute_forward_kl_topk` and `compute_distillation_loss_reverse_kl_estimator` (verl/trainer/distillation/losses.py),
and `_VocabParallelKLDivergence` with its hand-written backward at one tensor-parallel rank
(verl/trainer/distillation/megatron/losses.py); the tail bucket from verl's open PR #7855 (its test's coarse-grained
KL); slime's `apply_opd_kl_to_advantages` from THUDM/slime at 624b824a (slime/backends/megatron_utils/loss.py). Their
float32 casts are left out so that the oracles run in float64 like the inputs; verl's global batch counts are those
of one micro-batch (dp_size 1).
"""
import pytest
import torch

from megatron_cpo.algorithms.distillation import (
    DISTILLATION_LOSSES,
    DistillationInputs,
    TopKInputs,
    additive_advantages,
    distillation_loss,
    total_loss,
)
from megatron_cpo.algorithms.distillation_config import DISTILLATION_LOSS_MODES, DistillationLossConfig
from megatron_cpo.config import ConfigError

ESTIMATORS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl"]
AGGREGATIONS = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
SEEDS = range(3)


# ------------------------------------------------------------------ verl (transcribed)


def verl_kl_penalty(logprob, ref_logprob, kind):
    if kind in ("kl", "k1"):
        return logprob - ref_logprob
    if kind == "abs":
        return (logprob - ref_logprob).abs()
    if kind in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    kl = torch.clamp(ref_logprob - logprob, min=-20, max=20)
    return torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)


def verl_masked_sum(values, mask):
    return (torch.where(mask.bool(), values, 0.0) * mask).sum()


def verl_masked_mean(values, mask):
    return verl_masked_sum(values, mask) / (mask.sum() + 1e-8)


def verl_agg_loss(loss_mat, loss_mask, mode):
    if mode == "token-mean":
        return verl_masked_sum(loss_mat, loss_mask) / loss_mask.sum()
    if mode == "token-sum":
        return verl_masked_sum(loss_mat, loss_mask)
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        seq_losses = torch.sum(loss_mat * loss_mask, dim=-1)
        seq_mask = (torch.sum(loss_mask, dim=-1) > 0).float().to(loss_mat.dtype)
        loss = verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()
        return loss / loss_mask.shape[-1] if mode == "seq-mean-token-sum-norm" else loss
    seq_mask = torch.sum(loss_mask, dim=-1)
    seq_losses = torch.sum(loss_mat * loss_mask, dim=-1) / (seq_mask + 1e-8)
    seq_mask = (seq_mask > 0).to(loss_mat.dtype)
    return verl_masked_sum(seq_losses, seq_mask) / seq_mask.sum()


def verl_vanilla(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, low, high, clip_ratio_c=3.0):
    negative_approx_kl = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = verl_masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - low, 1 + high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = verl_masked_mean(torch.gt(pg_losses2, pg_losses1).to(ratio.dtype), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = verl_masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).to(ratio.dtype),
                                         response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    pg_loss = verl_agg_loss(pg_losses, response_mask, loss_agg_mode)
    return pg_loss, {"actor/pg_clipfrac": pg_clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
                     "actor/pg_clipfrac_lower": pg_clipfrac_lower.item()}


class VerlVocabParallelKL(torch.autograd.Function):
    """`_VocabParallelKLDivergence` at one tensor-parallel rank (the shard is the whole vocabulary, so the all-reduces
    are identities), forward and hand-written backward."""

    @staticmethod
    def forward(ctx, vp_logits, target_topk_logps, target_topk_indices, log_prob_min_clamp):
        logits_max = vp_logits.max(dim=-1).values
        shifted = vp_logits - logits_max.unsqueeze(-1)
        vp_source_logps = shifted - shifted.exp().sum(-1).log().unsqueeze(-1)
        vp_source_probs = torch.exp(vp_source_logps)
        target_topk_logps = target_topk_logps.clone()
        if log_prob_min_clamp is not None:
            target_topk_logps = target_topk_logps.clamp_min(log_prob_min_clamp)
        target_topk_probs = torch.exp(target_topk_logps)
        target_topk_mass = torch.sum(target_topk_probs, dim=-1)
        topk = target_topk_indices.size(-1)
        source_2d = vp_source_logps.view(-1, vp_logits.size(-1))
        rows = torch.arange(source_2d.size(0))
        vp_source_topk_logps = source_2d[rows.unsqueeze(-1), target_topk_indices.view(-1, topk)].view(
            target_topk_indices.shape)
        active_mask = torch.ones_like(target_topk_indices, dtype=torch.bool)
        if log_prob_min_clamp is not None:
            active_mask = active_mask & (vp_source_topk_logps > log_prob_min_clamp)
            vp_source_topk_logps = vp_source_topk_logps.clamp_min(log_prob_min_clamp)
            target_active_mass = (target_topk_probs * active_mask).sum(dim=-1)
        else:
            target_active_mass = target_topk_mass
        per_token_kl_loss = torch.sum(target_topk_probs * (target_topk_logps - vp_source_topk_logps), dim=-1)
        ctx.save_for_backward(vp_source_probs, target_topk_probs, target_topk_indices, active_mask, target_active_mass)
        per_token_topk_mass = torch.sum(vp_source_topk_logps.exp(), dim=-1)
        student_topk_ids = torch.topk(vp_source_logps, k=topk, dim=-1).indices
        per_target_token_kl = target_topk_probs * (target_topk_logps - vp_source_topk_logps)
        overlap_mask = (target_topk_indices.unsqueeze(-1) == student_topk_ids.unsqueeze(-2)).any(dim=-1)
        overlap_count = overlap_mask.sum(dim=-1)
        overlap_token_advantage = (-per_target_token_kl * overlap_mask).sum(dim=-1) / overlap_count.clamp_min(1)
        overlap_token_advantage = torch.where(overlap_count > 0, overlap_token_advantage,
                                              torch.zeros_like(overlap_token_advantage))
        outputs = (per_token_topk_mass.detach(), target_topk_mass.detach(), overlap_count, overlap_token_advantage)
        ctx.mark_non_differentiable(*outputs)
        return (per_token_kl_loss, *outputs)

    @staticmethod
    def backward(ctx, grad_loss, *unused):
        vp_source_probs, target_topk_probs, target_topk_indices, active_mask, target_active_mass = ctx.saved_tensors
        grad_input = vp_source_probs * target_active_mass.unsqueeze(-1)
        topk = target_topk_indices.size(-1)
        grad_2d = grad_input.view(-1, grad_input.size(-1))
        sub = target_topk_probs.view(-1, topk) * active_mask.view(-1, topk).to(grad_2d.dtype)
        grad_2d.scatter_add_(dim=1, index=target_topk_indices.view(-1, topk), src=-sub)
        grad_input.mul_(grad_loss.unsqueeze(dim=-1))
        return grad_input, None, None, None


def verl_topk_metrics(losses, student_mass, teacher_mass, overlap_count, overlap_token_advantage, mask, k):
    """`compute_forward_kl_topk` of losses.py: the metrics, then clamp_min(0)."""
    valid = mask.bool()
    valid_overlap_count = overlap_count[valid]
    positions = valid & (overlap_count > 0)
    metrics = {"distillation/overlap_ratio": (valid_overlap_count.double().mean() / k).item(),
               "distillation/overlap_token_advantage": overlap_token_advantage[positions].mean().item()
               if positions.any() else 0.0,
               "distillation/student_mass": student_mass[valid].mean().item(),
               "distillation/student_mass_min": student_mass[valid].min().item(),
               "distillation/student_mass_max": student_mass[valid].max().item(),
               "distillation/teacher_mass": teacher_mass[valid].mean().item(),
               "distillation/teacher_mass_min": teacher_mass[valid].min().item(),
               "distillation/teacher_mass_max": teacher_mass[valid].max().item()}
    return losses.clamp_min(0.0), metrics


def verl_distillation_loss(config, losses, metrics, log_prob, old_log_prob, mask, agg):
    """verl's `distillation_loss` after the mode's function: range metrics, clamp, then the PG or the loss form."""
    valid = mask.bool()
    metrics = {**metrics, "distillation/loss_min": losses[valid].min().item(),
               "distillation/loss_max": losses[valid].max().item()}
    if config.loss_max_clamp is not None:
        losses = losses.clamp(min=-config.loss_max_clamp, max=config.loss_max_clamp)
    if config.use_policy_gradient:
        loss, pg_metrics = verl_vanilla(old_log_prob, log_prob, -losses.detach(), mask, agg, config.clip_ratio_low,
                                        config.clip_ratio_high)
        metrics.update({f"distillation/{k[len('actor/'):]}": v for k, v in pg_metrics.items()})
    else:
        loss = verl_agg_loss(losses, mask, agg)
    return loss, metrics


def verl_distillation_ppo_loss(config, distill_loss, task_loss):
    policy_loss = task_loss if config.use_task_rewards else 0.0
    coef = config.distillation_loss_coef if config.use_task_rewards else 1.0
    return policy_loss + distill_loss * coef


def slime_apply_opd_kl_to_advantages(opd_kl_coef, teacher_log_probs, advantages, student_log_probs):
    reverse_kls = []
    for i, adv in enumerate(advantages):
        reverse_kl = student_log_probs[i] - teacher_log_probs[i]
        advantages[i] = adv - opd_kl_coef * reverse_kl
        reverse_kls.append(reverse_kl)
    return advantages, reverse_kls


# ------------------------------------------------------------------ inputs


def random_batch(seed: int, n: int = 6, width: int = 7, scale: float = 1.0):
    """Student / old / teacher log-probs [n, width] (float64), one empty response among ragged lengths."""
    gen = torch.Generator().manual_seed(seed)
    student = -scale * 3 * torch.rand(n, width, generator=gen, dtype=torch.float64)
    old = student + 0.3 * torch.randn(n, width, generator=gen, dtype=torch.float64)
    teacher = student + scale * torch.randn(n, width, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    return student, old, teacher.clamp(max=0.0), mask


def random_topk(seed: int, n: int = 5, width: int = 6, vocab: int = 40, k: int = 8, scale: float = 3.0):
    """Student logits [n, width, vocab], the teacher's top-k ids and log-probs of its own random distribution."""
    gen = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(n, width, vocab, generator=gen, dtype=torch.float64)
    teacher_logits = logits + scale * torch.randn(n, width, vocab, generator=gen, dtype=torch.float64)
    teacher_log_probs, teacher_ids = torch.topk(teacher_logits.log_softmax(-1), k, dim=-1)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[0] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    return logits, teacher_ids, teacher_log_probs, mask


def config_of(mode, **settings):
    return DistillationLossConfig(loss_mode=mode, **settings)


def check_metrics(ours, expected):
    for key, value in expected.items():
        assert ours[f"actor/{key}"] == pytest.approx(float(value), rel=1e-6, abs=1e-9), key


# ------------------------------------------------------------------ estimators


@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("mode, pg, clamp", [(m, pg, c) for m in ESTIMATORS for pg in (True, False)
                                             for c in (None, 0.5) if pg or m not in ("k1", "kl")])
def test_estimator_modes_equal_verl(agg, mode, pg, clamp):
    for seed in SEEDS:
        check_estimator_mode(seed, agg, mode, pg, clamp)


def check_estimator_mode(seed, agg, mode, pg, clamp):
    student, old, teacher, mask = random_batch(seed)
    config = config_of(mode, use_policy_gradient=pg, loss_max_clamp=clamp)
    ours_lp = student.clone().requires_grad_()
    loss, metrics = distillation_loss(DistillationInputs(ours_lp, mask, teacher_log_probs=teacher), old, config, agg)
    loss.backward()

    verl_lp = student.clone().requires_grad_()
    losses = verl_kl_penalty(verl_lp, teacher, mode)
    expected_metrics = {"distillation/abs_loss": losses[mask.bool()].abs().mean().item()}
    expected, expected_metrics = verl_distillation_loss(config, losses, expected_metrics, verl_lp, old, mask, agg)
    expected.backward()

    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    valid = mask.bool()
    torch.testing.assert_close(ours_lp.grad[valid], verl_lp.grad[valid], rtol=1e-6, atol=1e-9)
    assert not ours_lp.grad[~valid].any()
    check_metrics(metrics, {**expected_metrics, "distillation/loss": expected.item()})


@pytest.mark.parametrize("mode", ESTIMATORS)
def test_extreme_log_probs_and_clamps_equal_verl(mode):
    """Log-probs down to -1e3 (k3's log-ratio clamp at 20 and result clamp at 10), the loss clamp active."""
    student = torch.tensor([[-1e3, -50.0, -1e-9, -3.0], [-0.5, -700.0, -20.0, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1e-6, -1e3, -60.0, -3.0], [-25.0, -1e-3, -21.0, -80.0]], dtype=torch.float64)
    mask = torch.ones_like(student)
    for clamp in (None, 10.0):
        config = config_of(mode, use_policy_gradient=True, loss_max_clamp=clamp)
        loss, metrics = distillation_loss(DistillationInputs(student, mask, teacher_log_probs=teacher), student,
                                          config, "token-mean")
        losses = verl_kl_penalty(student, teacher, mode)
        expected, expected_metrics = verl_distillation_loss(
            config, losses, {"distillation/abs_loss": losses.abs().mean().item()}, student, student, mask, "token-mean")
        torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
        check_metrics(metrics, expected_metrics)
        assert torch.isfinite(loss)


@pytest.mark.parametrize("mode", sorted(DISTILLATION_LOSS_MODES))
def test_a_teacher_equal_to_the_student_gives_no_signal(mode):
    """Teacher = student: D = 0 on every token (a top-k teacher that is the student's own top-k over the whole
    vocabulary), so the loss and its gradient vanish in both forms."""
    logits, _, _, mask = random_topk(3, vocab=12, k=12)
    ids = torch.topk(logits, 12, dim=-1).indices
    for pg in (True, False) if DISTILLATION_LOSS_MODES[mode].has_gradient else (True,):
        leaf = logits.clone().requires_grad_()
        student_all = leaf.log_softmax(-1)
        lp, topk_lp = student_all[..., 0], student_all.gather(-1, ids)
        inputs = DistillationInputs(lp, mask, teacher_log_probs=lp.detach(),
                                    topk=TopKInputs(ids, topk_lp.detach(), topk_lp, ids))
        loss, metrics = distillation_loss(inputs, lp.detach(), config_of(mode, use_policy_gradient=pg), "token-mean")
        loss.backward()
        assert abs(float(loss.detach())) < 1e-9 and metrics["actor/distillation/loss_max"] < 1e-9, (mode, pg)
        assert leaf.grad.abs().max() < 1e-9, (mode, pg)


# ------------------------------------------------------------------ top-k forward KL


@pytest.mark.parametrize("clamp", [None, -10.0, -2.0])
@pytest.mark.parametrize("loss_clamp", [None, 0.3])
def test_forward_kl_topk_equals_verls_megatron_loss_gradient_and_metrics(clamp, loss_clamp):
    for seed in SEEDS:
        check_forward_kl_topk(seed, clamp, loss_clamp)


def check_forward_kl_topk(seed, clamp, loss_clamp):
    logits, ids, teacher_lp, mask = random_topk(seed)
    k = ids.shape[-1]
    config = config_of("forward_kl_topk", topk=k, log_prob_min_clamp=clamp, loss_max_clamp=loss_clamp)

    ours_logits = logits.clone().requires_grad_()
    student_all = ours_logits.log_softmax(-1)
    inputs = DistillationInputs(student_all[..., 0], mask, topk=TopKInputs(
        ids, teacher_lp, student_all.gather(-1, ids), torch.topk(logits, k, dim=-1).indices))
    loss, metrics = distillation_loss(inputs, None, config, "token-mean")
    loss.backward()

    verl_logits = logits.clone().requires_grad_()
    losses, *parts = VerlVocabParallelKL.apply(verl_logits, teacher_lp, ids, clamp)
    losses, expected_metrics = verl_topk_metrics(losses, *parts, mask, k)
    expected, expected_metrics = verl_distillation_loss(config, losses, expected_metrics, None, None, mask,
                                                        "token-mean")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours_logits.grad, verl_logits.grad, rtol=1e-6, atol=1e-9)
    check_metrics(metrics, expected_metrics)


def test_forward_kl_topk_as_a_reward_uses_the_clipped_objective():
    """verl allows the top-k KL as the policy-gradient reward (it warns that the top-k signal is then unused)."""
    logits, ids, teacher_lp, mask = random_topk(7)
    student_all = logits.log_softmax(-1)
    old = student_all[..., 3]
    lp = (old - 0.3).clone().requires_grad_()  # ratio 0.74 < 1 - 0.2: clipped where A = -D < 0
    config = config_of("forward_kl_topk", topk=ids.shape[-1], use_policy_gradient=True, clip_ratio_high=0.28)
    inputs = DistillationInputs(lp, mask, topk=TopKInputs(ids, teacher_lp, student_all.gather(-1, ids)))
    loss, metrics = distillation_loss(inputs, old, config, "seq-mean-token-mean")
    losses, *parts = VerlVocabParallelKL.apply(logits, teacher_lp, ids, None)
    losses, _ = verl_topk_metrics(losses, *parts, mask, ids.shape[-1])
    expected, _ = verl_vanilla(old, lp.detach(), -losses, mask, "seq-mean-token-mean", 0.2, 0.28)
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-6, atol=1e-9)
    assert metrics["actor/distillation/pg_clipfrac"] > 0


def coarse_grained_kl(teacher_all, student_all, ids):
    """PR #7855's oracle: the exact KL after the vocabulary is coarse-grained to the teacher's top-k ids plus one
    bucket for every other token."""
    teacher_topk, student_topk = teacher_all.gather(-1, ids).exp(), student_all.gather(-1, ids).exp()
    teacher_coarse = torch.cat([teacher_topk, (1.0 - teacher_topk.sum(-1, keepdim=True)).clamp_min(0.0)], -1)
    student_coarse = torch.cat([student_topk, (1.0 - student_topk.sum(-1, keepdim=True)).clamp_min(1e-12)], -1)
    return (torch.xlogy(teacher_coarse, teacher_coarse) - torch.xlogy(teacher_coarse, student_coarse)).sum(-1)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("k", [1, 8, 40])
def test_forward_kl_topk_tail_is_the_coarse_grained_kl_with_its_gradient(seed, k):
    logits, _, _, mask = random_topk(seed, k=1)
    gen = torch.Generator().manual_seed(100 + seed)
    teacher_all = (logits + 3 * torch.randn(logits.shape, generator=gen, dtype=torch.float64)).log_softmax(-1)
    teacher_lp, ids = torch.topk(teacher_all, k, dim=-1)
    config = config_of("forward_kl_topk_tail", topk=k, tail_mass_eps=1e-12)
    ours_logits = logits.clone().requires_grad_()
    student_all = ours_logits.log_softmax(-1)
    topk = TopKInputs(ids, teacher_lp, student_all.gather(-1, ids))
    inputs = DistillationInputs(student_all[..., 0], mask, topk=topk)
    loss, metrics = distillation_loss(inputs, None, config, "token-sum")
    loss.backward()
    oracle_logits = logits.clone().requires_grad_()
    expected_tokens = coarse_grained_kl(teacher_all, oracle_logits.log_softmax(-1), ids)
    expected = verl_agg_loss(expected_tokens, mask, "token-sum")
    expected.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(ours_logits.grad, oracle_logits.grad, rtol=1e-6, atol=1e-9)
    valid = mask.bool()
    full_kl = (teacher_all.exp() * (teacher_all - logits.log_softmax(-1))).sum(-1)
    assert bool((expected_tokens[valid] <= full_kl[valid] + 1e-9).all())  # a lower bound of the full KL
    if k == 40:  # the top-k spans the vocabulary: the tail is empty and the loss is the full KL
        assert metrics["actor/distillation/tail_loss"] == pytest.approx(0.0, abs=1e-9)
        torch.testing.assert_close(expected_tokens[valid], full_kl[valid], rtol=1e-6, atol=1e-9)
    parts = metrics["actor/distillation/topk_loss"] + metrics["actor/distillation/tail_loss"]
    assert parts == pytest.approx(float(expected_tokens[valid].mean()), rel=1e-6)


def test_the_tail_bucket_floors_the_students_tail_mass():
    """A student that puts all its mass on the teacher's top-k: its tail is floored at tail_mass_eps, so the loss
    stays finite (p_tail * log(p_tail / eps))."""
    student = torch.tensor([[[0.0, -80.0]]], dtype=torch.float64)  # log q of the two ids: the first holds all mass
    teacher = torch.tensor([[[0.5, 0.3]]], dtype=torch.float64).log()
    ids = torch.tensor([[[0, 1]]])
    config = config_of("forward_kl_topk_tail", topk=2, tail_mass_eps=1e-6)
    loss, _ = distillation_loss(DistillationInputs(student[..., 0], torch.ones(1, 1), topk=TopKInputs(
        ids, teacher, student)), None, config, "token-mean")
    expected = 0.5 * torch.log(torch.tensor(0.5)) + 0.3 * (torch.log(torch.tensor(0.3)) + 80.0) \
        + 0.2 * (torch.log(torch.tensor(0.2)) - torch.log(torch.tensor(1e-6)))
    assert float(loss) == pytest.approx(float(expected), rel=1e-6)


# ------------------------------------------------------------------ combination and slime


@pytest.mark.parametrize("use_task_rewards, use_policy_gradient", [(True, True), (True, False), (False, True),
                                                                   (False, False)])
def test_the_total_loss_combines_as_verls_distillation_ppo_loss(use_task_rewards, use_policy_gradient):
    config = config_of("k3", use_task_rewards=use_task_rewards, use_policy_gradient=use_policy_gradient,
                       distillation_loss_coef=0.25)
    task, distill = torch.tensor(1.5, dtype=torch.float64), torch.tensor(0.7, dtype=torch.float64)
    expected = verl_distillation_ppo_loss(config, distill, task)
    torch.testing.assert_close(total_loss(task if use_task_rewards else None, distill, config),
                               torch.as_tensor(expected, dtype=torch.float64))


@pytest.mark.parametrize("seed", SEEDS)
def test_additive_form_equals_slimes(seed):
    student, _, teacher, mask = random_batch(seed)
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(student.shape[0], 1, generator=gen, dtype=torch.float64).expand_as(student).clone()
    shaped, metrics = additive_advantages(advantages, student, teacher, mask, coef=0.7)
    lengths = mask.sum(-1).long().tolist()
    rows = [i for i, length in enumerate(lengths) if length]
    expected, reverse_kls = slime_apply_opd_kl_to_advantages(
        0.7, [teacher[i, :lengths[i]] for i in rows], [advantages[i, :lengths[i]].clone() for i in rows],
        [student[i, :lengths[i]] for i in rows])
    for i, row in zip(rows, expected):
        torch.testing.assert_close(shaped[i, :lengths[i]], row, rtol=1e-6, atol=1e-9)
    assert not shaped[~mask.bool()].any()
    slime_metric = sum(kl.mean() for kl in reverse_kls) / len(reverse_kls)  # sum_of_sample_mean / samples
    assert metrics["distillation/opd_reverse_kl"] == pytest.approx(float(slime_metric), rel=1e-6)


def test_every_mode_name_has_its_divergence():
    assert set(DISTILLATION_LOSSES) == set(DISTILLATION_LOSS_MODES)


@pytest.mark.parametrize("settings, message", [
    (dict(loss_mode="forward_kl_topk_tail", log_prob_min_clamp=-10.0), "requires log_prob_min_clamp=null"),
    (dict(loss_mode="forward_kl_topk", topk=0), "topk=0 must be >= 1"),
    (dict(loss_mode="js"), "loss_mode='js' is not supported"),
    (dict(policy_loss_mode="gspo"), "policy_loss_mode='gspo' is not supported; choose one of 'vanilla'"),
    (dict(tail_mass_eps=0.0), "tail_mass_eps=0.0 must be in (0, 1)"),
    (dict(loss_max_clamp=-1), "loss_max_clamp=-1.0 must be > 0"),
])
def test_what_verl_refuses_is_refused_with_the_key_and_the_fix(settings, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        DistillationLossConfig(**settings)


def test_k1_as_a_loss_is_a_problem_unless_it_is_a_reward():
    """k1's gradient as a loss ignores the teacher: `distillation.*` refuses it (tests/trainer/test_verl_opd_scripts.py)
    unless slime's additive form, which has no loss term, reads the k1 difference."""
    problem = DistillationLossConfig(loss_mode="k1").gradient_problem()
    assert "loss_mode=k1 as a loss (use_policy_gradient=false)" in problem
    assert "loss_mode=kl as a loss" in DistillationLossConfig(loss_mode="kl").gradient_problem()
    assert DistillationLossConfig(loss_mode="k1", use_policy_gradient=True).gradient_problem() is None
    assert DistillationLossConfig(loss_mode="k3").gradient_problem() is None
