"""Every variant name a setting accepts (declared torch-free in algorithms/config.py and cpo_rules.py, so that
loading a config needs no torch) has its implementation in the table of the math module, and every implementation
is reachable by a name: the two lists cannot drift apart."""
from megatron_cpo.algorithms import config, cpo, cpo_rules, filters, kl, losses


def test_each_table_implements_exactly_the_names_its_setting_accepts():
    assert set(kl.KL_ESTIMATORS) == set(config.KL_ESTIMATOR_KINDS)
    assert set(losses.LOSS_AGGREGATIONS) == set(config.LOSS_AGGREGATION_MODES)
    assert set(filters.RAGEN_STRATEGIES) == set(config.RAGEN_STRATEGY_NAMES)
    assert set(filters.FILTER_LOSS_SCALINGS) == set(config.FILTER_LOSS_SCALING_MODES)
    assert set(config.RAGEN_FILTER_METRICS.values()) == set(filters.GROUP_SCORES)


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
