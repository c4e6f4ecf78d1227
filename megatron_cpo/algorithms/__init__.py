"""Pure tensor math of the RL algorithms: advantages, losses, CPO shaping, group filters.

Torch only: no I/O, no torch.distributed, no Python loop over samples, groups or tokens. Prompt groups are given as
`group: LongTensor[N]` of indices 0..G-1.

- groups.py: per-group count / sum / mean / std / min / max by scatter reductions.
- masked.py: masked sum / mean that ignore padded values, NaN and inf included (select, not multiply).
- advantages.py: the advantage estimators under verl's names (GRPO, RLOO, REINFORCE++, ReMax, OPO, GPG, pass@k, GAE),
  one function and one row each (returns.py: the reverse scan, discounted returns, GAE, whitening).
- policy_losses.py: the policy-loss modes under verl's names (PPO clip, GSPO, SAPO, CISPO, GMPO, GPG, Clip-Cov,
  KL-Cov), one class each.
- value_loss.py: the critic's clipped value loss (PPO with GAE) and verl's value metrics.
- aggregation.py: the loss aggregations (`loss_agg_mode`), as additive shares of the batch loss.
- losses.py: the actor's whole loss (the mode's term, aggregation, entropy bonus and mask, KL loss; kl.py: KL
  estimators; mismatch.py: rollout/trainer mismatch metrics and TIS, re-exported by losses.py).
- distillation.py: on-policy distillation's per-token divergences (verl's loss modes: reverse-KL estimators, top-k
  forward KL with or without the tail bucket), its policy-gradient and loss forms, slime's additive form
  (distillation_config.py: the `distillation.distillation_loss` section).
- cpo.py: difficulty mask, CPO's shaping rules on typed inputs (`ShapingInputs`); cpo_rules.py: the rules as data and
  CPO's config (`algorithm.cpo`), torch-free.
- shapers.py: the advantage shaper `algorithm.adv_estimator` selects (the estimator's as is, CPO's rule).
- filters.py: DAPO filter-groups, RAGEN filters, filter loss scaling.
- overlong.py: DAPO overlong reward shaping.
- config.py: the algorithms' settings, torch-free (`algorithm.*`, RAGEN's filter, the overlong buffer), the names
  each accepts and what each estimator needs; loss_config.py: the policy loss's (its modes and what each defines, TIS).
"""
