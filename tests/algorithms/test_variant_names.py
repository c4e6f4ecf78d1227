"""Every variant name a setting accepts (declared torch-free in algorithms/config.py and cpo_rules.py, so that
loading a config needs no torch) has its implementation in the table of the math module, and every implementation
is reachable by a name: the two lists cannot drift apart."""
from megatron_cpo.algorithms import (
    advantages,
    config,
    cpo,
    cpo_rules,
    filters,
    kl,
    loss_config,
    losses,
    policy_losses,
    rollout_correction,
)


def test_each_table_implements_exactly_the_names_its_setting_accepts():
    assert set(kl.KL_ESTIMATORS) == set(config.KL_ESTIMATOR_KINDS)
    assert set(losses.LOSS_AGGREGATIONS) == set(config.LOSS_AGGREGATION_MODES)
    assert set(filters.RAGEN_STRATEGIES) == set(config.RAGEN_STRATEGY_NAMES)
    assert set(filters.FILTER_LOSS_SCALINGS) == set(config.FILTER_LOSS_SCALING_MODES)
    assert set(config.RAGEN_FILTER_METRICS.values()) == set(filters.GROUP_SCORES)
    assert set(advantages.ADVANTAGE_ESTIMATORS) == set(config.ADVANTAGE_ESTIMATOR_NEEDS)
    assert set(policy_losses.POLICY_LOSS_MODES) == set(loss_config.POLICY_LOSS_MODE_RULES)
    assert set(config.ESTIMATOR_ALIASES.values()) <= set(config.ADVANTAGE_ESTIMATOR_NEEDS)
    assert set(config.CPO_BASE_ESTIMATORS) <= {name for name, needs in config.ADVANTAGE_ESTIMATOR_NEEDS.items()
                                               if needs.grouped}
    assert set(loss_config.LOSS_MODE_CHECKS) <= set(loss_config.POLICY_LOSS_MODE_RULES)
    for rules in loss_config.POLICY_LOSS_MODE_RULES.values():
        assert rules.policy_aggregation in (None, *config.LOSS_AGGREGATION_MODES)


def test_every_divergence_bound_is_computed():
    """Each of verl's rejection options the config accepts names an aggregate and an estimator `divergence` knows."""
    import torch

    log_ratio, valid = torch.tensor([[0.1, -0.2]]), torch.tensor([[True, True]])
    for option in config.DIVERGENCE_RS:
        statistic = rollout_correction.divergence(log_ratio, valid, option)
        assert statistic.shape == (1, 2) and bool((statistic > 0).all()), option


def test_every_estimator_name_selects_the_estimator_it_names():
    """`kl` / `k1`, `mse` / `k2` and `low_var_kl` / `k3` are aliases of one function each; `abs` is its own."""
    by_function = {}
    for name, estimator in config.KL_ESTIMATOR_KINDS.items():
        by_function.setdefault(kl.KL_ESTIMATORS[name], set()).add(estimator)
    assert all(len(estimators) == 1 for estimators in by_function.values())
    assert len(by_function) == len(set(config.KL_ESTIMATOR_KINDS.values())) == 4


def test_the_rule_table_only_names_parts_cpo_implements():
    """cpo.py checks this at import too; here it is stated against the torch-free table the config reads."""
    for rule in cpo_rules.SHAPING_RULES.values():
        for term in rule.terms:
            assert set(term.where) <= set(cpo.SELECTORS) and set(term.factors) <= set(cpo.FACTORS), rule.name
            assert term.apply in cpo.APPLY and term.alpha in ("pos", "neg"), rule.name
