"""Sections of the run's config tree that belong to one component: `actor_rollout_ref.*` and `reward.*`.

`megatron_cpo.config` is the root (`Config`) and re-exports every section; load configs through it.
"""
