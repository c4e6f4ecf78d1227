"""Pure tensor math of the RL algorithms: advantages, losses, CPO shaping, group filters.

Torch only: no I/O, no torch.distributed, no Python loop over samples, groups or tokens. Prompt groups are given as
`group: LongTensor[N]` of indices 0..G-1.

- groups.py: per-group count / sum / mean / std / min / max by scatter reductions.
- masked.py: masked sum / mean that ignore padded values, NaN and inf included (select, not multiply).
- advantages.py: GRPO and Dr.GRPO advantages.
- losses.py: clipped policy loss, loss aggregation, entropy mask (kl.py: KL estimators; mismatch.py: rollout/trainer
  mismatch metrics and TIS, re-exported by losses.py).
- cpo.py: difficulty mask, the shaping-rule table.
- shapers.py: the advantage shaper `algorithm.adv_estimator` selects (GRPO as is, CPO's rule) and CPO's config.
- filters.py: DAPO filter-groups, RAGEN filters, filter loss scaling.
- overlong.py: DAPO overlong reward shaping.
- config.py: the `algorithm.*` section (estimator, filter-groups, KL in the reward, CPO's settings).
"""
