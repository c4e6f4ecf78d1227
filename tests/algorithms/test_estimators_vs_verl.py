"""Every advantage estimator against verl's definition, to 1e-6, on random batches that hold the edge cases: empty
responses, holes in the mask (a multi-turn episode's observation tokens), groups of one, groups whose responses all
scored the same, and gamma / lam other than 1.

The oracles below are transcribed from verl's reference loops (verl/trainer/ppo/core_algos.py and
verl/utils/torch_functional.py, volcengine/verl at b178a3cd, January 2026): per-sample and per-token Python loops,
kept as loops on purpose so that they share nothing with the vectorised code under test. Values on masked-out
positions are not compared: verl leaves numbers there that no loss reads, ours are 0.
"""
from collections import defaultdict

import pytest
import torch

from megatron_cpo.algorithms.advantages import ADVANTAGE_ESTIMATORS, AdvantageInputs
from megatron_cpo.algorithms.config import ESTIMATOR_ALIASES, AlgorithmConfig
from megatron_cpo.algorithms.returns import reverse_linear_scan

SEEDS = range(12)


# ------------------------------------------------------------------ verl's reference loops (transcribed)


def verl_masked_whiten(values, mask):
    mean = (values * mask).sum() / (mask.sum() + 1e-8)
    variance = ((values - mean) ** 2 * mask).sum() / (mask.sum() + 1e-8)
    variance = variance * mask.sum() / (mask.sum() - 1)
    return (values - mean) * torch.rsqrt(variance + 1e-8)


def by_group(scores, index):
    groups = defaultdict(list)
    for i in range(len(scores)):
        groups[index[i]].append(scores[i])
    return groups


def verl_grpo(rewards, mask, index, norm=True, eps=1e-6):
    scores = rewards.sum(-1)
    groups = by_group(scores, index)
    out = scores.clone()
    for i in range(len(scores)):
        values = torch.stack(groups[index[i]])
        mean, std = (torch.tensor(0.0), torch.tensor(1.0)) if len(values) == 1 else (values.mean(), values.std())
        out[i] = (scores[i] - mean) / (std + eps) if norm else scores[i] - mean
    return out[:, None] * mask


def verl_grpo_passk(rewards, mask, index, norm=True, eps=1e-6):
    scores = rewards.sum(-1)
    advantages = torch.zeros_like(scores)
    positions = defaultdict(list)
    for i in range(len(scores)):
        positions[index[i]].append(i)
    for rows in positions.values():
        values = scores[rows]
        top, top_index = torch.topk(values, 2)
        advantage = top[0] - top[1]
        if norm:
            advantage = advantage / (torch.std(values) + eps)
        advantages[rows[int(top_index[0])]] = advantage
    return advantages[:, None] * mask


def verl_rloo(rewards, mask, index):
    scores = rewards.sum(-1)
    groups = by_group(scores, index)
    out = scores.clone()
    for i in range(len(scores)):
        n = len(groups[index[i]])
        if n > 1:
            mean = torch.stack(groups[index[i]]).mean()
            out[i] = scores[i] * n / (n - 1) - mean * n / (n - 1)
    return out[:, None] * mask


def verl_opo(rewards, mask, index):
    lengths, scores = mask.sum(-1), rewards.sum(-1)
    score_groups, length_groups = by_group(scores, index), by_group(lengths, index)
    out = scores.clone()
    for i in range(len(scores)):
        if len(score_groups[index[i]]) == 1:
            baseline = 0.0
        else:
            weights = torch.stack(length_groups[index[i]])
            baseline = (weights * torch.stack(score_groups[index[i]])).sum() / weights.sum()
        out[i] = scores[i] - baseline
    return out[:, None] * mask


def verl_gpg(rewards, mask, index):
    scores = rewards.sum(-1)
    alpha = len(scores) / torch.count_nonzero(scores).clamp(min=1)
    groups = by_group(scores, index)
    out = scores.clone()
    for i in range(len(scores)):
        mean = torch.tensor(0.0) if len(groups[index[i]]) == 1 else torch.stack(groups[index[i]]).mean()
        out[i] = alpha * (scores[i] - mean)
    return out[:, None] * mask


def verl_reinforce_plus_plus_baseline(rewards, mask, index):
    scores = rewards.sum(-1)
    groups = by_group(scores, index)
    out = scores.clone()
    for i in range(len(scores)):
        mean = torch.tensor(0.0) if len(groups[index[i]]) == 1 else torch.stack(groups[index[i]]).mean()
        out[i] = scores[i] - mean
    tiled = out[:, None].tile([1, rewards.shape[1]]) * mask
    return verl_masked_whiten(tiled, mask) * mask


def verl_reinforce_plus_plus(rewards, mask, gamma):
    returns = torch.zeros_like(rewards)
    running = 0
    for t in reversed(range(rewards.shape[1])):
        running = rewards[:, t] + gamma * running
        returns[:, t] = running
        running = running * mask[:, t]
    return verl_masked_whiten(returns, mask) * mask, returns


def verl_remax(rewards, baselines, mask):
    returns = (rewards * mask).flip(dims=[-1]).cumsum(dim=-1).flip(dims=[-1])
    return returns - baselines[:, None] * mask, returns


def verl_gae(rewards, values, mask, gamma, lam):
    next_values, last = 0, 0
    reversed_advantages = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_ = delta + gamma * lam * last
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last = last_ * mask[:, t] + (1 - mask[:, t]) * last
        reversed_advantages.append(last)
    advantages = torch.stack(reversed_advantages[::-1], dim=1)
    return verl_masked_whiten(advantages, mask), advantages + values


# ------------------------------------------------------------------ random batches with the edge cases


def random_batch(seed: int, width: int = 7, singletons: bool = True) -> dict:
    """Groups of 1-5 responses (one of one unless `singletons` is off), interleaved; one group whose responses all
    score the same; an empty response; random holes in some masks; dense token rewards (a KL penalty's shape)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [1 if singletons else 2, 3, *torch.randint(2 if not singletons else 1, 6, (3,), generator=gen).tolist()]
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))
    order = torch.randperm(len(group), generator=gen)
    group = group[order]
    n = len(group)
    lengths = torch.randint(1, width + 1, (n,), generator=gen)
    lengths[int(torch.randint(0, n, (1,), generator=gen))] = 0
    mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
    holes = (torch.rand(n, width, generator=gen) < 0.2) & (torch.rand(n, 1, generator=gen) < 0.4)
    mask = torch.where(holes, 0.0, mask)
    rewards = torch.randn(n, width, generator=gen, dtype=torch.float64) * 0.1 * mask
    last = (lengths - 1).clamp(min=0)
    outcome = torch.randint(0, 3, (n,), generator=gen).double() / 2
    outcome[group == 1] = 0.5  # all-equal group (exactly representable)
    rewards[torch.arange(n), last] += outcome
    equal = group == 1
    rewards[equal] = 0.0
    rewards[equal, 0] = 0.5  # its token rewards too, so its scores are exactly equal
    return {"rewards": rewards, "mask": mask, "group": group, "index": group.tolist(),
            "values": torch.randn(n, width, generator=gen, dtype=torch.float64),
            "baselines": torch.randint(0, 3, (n,), generator=gen).double() / 2,
            "gamma": float(torch.empty(1).uniform_(0.8, 1.0, generator=gen)),
            "lam": float(torch.empty(1).uniform_(0.7, 1.0, generator=gen))}


def run(name: str, b: dict, **overrides) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = AdvantageInputs(b["rewards"], b["mask"], b["group"], gamma=b["gamma"], lam=b["lam"],
                             values=b["values"], reward_baselines=b["baselines"], **overrides)
    return ADVANTAGE_ESTIMATORS[name](inputs)


def assert_on_mask(ours: torch.Tensor, expected: torch.Tensor, mask: torch.Tensor) -> None:
    valid = mask.bool()
    torch.testing.assert_close(ours[valid], expected[valid], rtol=0, atol=1e-6)
    assert not ours[~valid].any(), "values off the mask must be 0"


# ------------------------------------------------------------------ the tests


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name, oracle", [
    ("grpo", lambda b: verl_grpo(b["rewards"], b["mask"], b["index"])),
    ("rloo", lambda b: verl_rloo(b["rewards"], b["mask"], b["index"])),
    ("opo", lambda b: verl_opo(b["rewards"], b["mask"], b["index"])),
    ("gpg", lambda b: verl_gpg(b["rewards"], b["mask"], b["index"])),
    ("reinforce_plus_plus_baseline", lambda b: verl_reinforce_plus_plus_baseline(b["rewards"], b["mask"], b["index"])),
])
def test_outcome_estimators_equal_verl(seed, name, oracle):
    b = random_batch(seed)
    advantages, returns = run(name, b)
    assert_on_mask(advantages, oracle(b), b["mask"])
    torch.testing.assert_close(returns, advantages)  # verl returns the advantages as the returns


@pytest.mark.parametrize("seed", SEEDS)
def test_dr_grpo_equals_verl_without_the_std(seed):
    b = random_batch(seed)
    assert_on_mask(run("grpo", b, norm_by_std=False)[0], verl_grpo(b["rewards"], b["mask"], b["index"], norm=False),
                   b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm", [True, False])
def test_grpo_passk_equals_verl(seed, norm):
    b = random_batch(seed, singletons=False)
    assert_on_mask(run("grpo_passk", b, norm_by_std=norm)[0],
                   verl_grpo_passk(b["rewards"], b["mask"], b["index"], norm=norm), b["mask"])


def test_grpo_passk_refuses_a_group_of_one_as_verl_does():
    with pytest.raises(ValueError, match="at least 2 responses"):
        run("grpo_passk", random_batch(0))


@pytest.mark.parametrize("seed", SEEDS)
def test_reinforce_plus_plus_equals_verl(seed):
    b = random_batch(seed)
    advantages, returns = run("reinforce_plus_plus", b)
    expected_advantages, expected_returns = verl_reinforce_plus_plus(b["rewards"], b["mask"], b["gamma"])
    assert_on_mask(advantages, expected_advantages, b["mask"])
    assert_on_mask(returns, expected_returns, b["mask"])


@pytest.mark.parametrize("seed", SEEDS)
def test_remax_equals_verl(seed):
    b = random_batch(seed)
    advantages, returns = run("remax", b)
    expected_advantages, expected_returns = verl_remax(b["rewards"], b["baselines"], b["mask"])
    assert_on_mask(advantages, expected_advantages, b["mask"])
    torch.testing.assert_close(returns, expected_returns, rtol=0, atol=1e-6)


@pytest.mark.parametrize("seed", SEEDS)
def test_gae_equals_verl(seed):
    b = random_batch(seed)
    advantages, returns = run("gae", b)
    expected_advantages, expected_returns = verl_gae(b["rewards"], b["values"], b["mask"], b["gamma"], b["lam"])
    assert_on_mask(advantages, expected_advantages, b["mask"])
    assert_on_mask(returns, expected_returns, b["mask"])


def test_gae_hand_computed():
    # one response of 3 tokens, reward 1 on the last; gamma 0.5, lam 0.5; V = (0.2, 0.4, 0.6)
    # deltas: 0 + 0.5*0.4 - 0.2 = 0; 0 + 0.5*0.6 - 0.4 = -0.1; 1 - 0.6 = 0.4
    # A: 0.4; -0.1 + 0.25*0.4 = 0; 0 + 0.25*0 = 0 -> returns A + V = (0.2, 0.4, 1.0)
    inputs = AdvantageInputs(torch.tensor([[0.0, 0.0, 1.0]]), torch.ones(1, 3), torch.tensor([0]), gamma=0.5,
                             lam=0.5, values=torch.tensor([[0.2, 0.4, 0.6]]))
    _, returns = ADVANTAGE_ESTIMATORS["gae"](inputs)
    torch.testing.assert_close(returns, torch.tensor([[0.2, 0.4, 1.0]]))


def test_the_scan_solves_its_recurrence_for_long_rows():
    """x_t = b_t + a_t x_{t+1} over 1000 positions with zeros and tiny coefficients (no overflow, no NaN)."""
    gen = torch.Generator().manual_seed(0)
    a = torch.rand(3, 1000, generator=gen, dtype=torch.float64) * (torch.rand(3, 1000, generator=gen) > 0.01)
    b = torch.randn(3, 1000, generator=gen, dtype=torch.float64)
    expected, running = torch.zeros_like(b), torch.zeros(3, dtype=torch.float64)
    for t in reversed(range(1000)):
        running = b[:, t] + a[:, t] * running
        expected[:, t] = running
    torch.testing.assert_close(reverse_linear_scan(a, b), expected)


def test_verls_vectorized_names_are_the_same_estimators():
    assert ESTIMATOR_ALIASES == {"grpo_vectorized": "grpo", "rloo_vectorized": "rloo"}
    for alias, name in ESTIMATOR_ALIASES.items():
        assert AlgorithmConfig(adv_estimator=alias).estimator_name == name
    with pytest.raises(ValueError, match="algorithm.adv_estimator='ppo' is not supported"):
        AlgorithmConfig(adv_estimator="ppo")


def test_float32_inputs_give_float32_advantages():
    b = random_batch(3)
    inputs = AdvantageInputs(b["rewards"].float(), b["mask"].float(), b["group"], values=b["values"].float(),
                             reward_baselines=b["baselines"].float())
    for name, compute in ADVANTAGE_ESTIMATORS.items():
        if name == "grpo_passk":
            continue
        advantages, returns = compute(inputs)
        assert advantages.dtype == returns.dtype == torch.float32, name
        assert torch.isfinite(advantages).all(), name
