"""verl's names for the metrics we log, so dashboards built on verl runs keep working (`trainer.log_verl_metric_names`).

Our names stay; at log time each metric that measures the same quantity as one of verl's is also logged under
verl's name. Only true equivalents are mapped: e.g. our `kl` (actor vs reference, for monitoring) is not verl's
`actor/ppo_kl` (old vs new policy, which is our `ppo_kl`).
"""
from __future__ import annotations

import re

# our name -> verl's name (same quantity, same units)
VERL_NAMES: dict[str, str] = {
    "reward/mean": "critic/score/mean",
    "reward/max": "critic/score/max",
    "reward/min": "critic/score/min",
    "advantages/mean": "critic/advantages/mean",
    "completions/mean_length": "response_length/mean",
    "completions/max_length": "response_length/max",
    "completions/min_length": "response_length/min",
    "completions/clipped_ratio": "response_length/clip_ratio",
    "pg_loss": "actor/pg_loss",
    "pg_clipfrac": "actor/pg_clipfrac",
    "pg_clipfrac_lower": "actor/pg_clipfrac_lower",
    "ppo_kl": "actor/ppo_kl",
    "kl_loss": "actor/kl_loss",
    "entropy/mean": "actor/entropy",
    "filter/num_gen_batches": "train/num_gen_batches",
    "train/epoch": "training/epoch",
    "timing/step_s": "timing_s/step",
    "timing/gen_s": "timing_s/gen",
    "timing/weight_sync_s": "timing_s/update_weights",
    "timing/val_s": "timing_s/testing",
}
# Per data source validation: our val/<source>/<acc|score> -> verl's val-core/<source>/<acc|reward>/mean@<n>.
_VAL_SOURCE = re.compile(r"^val/(?P<source>.+)/(?P<kind>acc|score)$")


def with_verl_names(metrics: dict[str, float], step: int, val_samples: int = 1) -> dict[str, float]:
    """`metrics` plus the same values under verl's names; `val_samples` is n of the validation's mean@n."""
    out = dict(metrics)
    for ours, theirs in VERL_NAMES.items():
        if ours in metrics:
            out.setdefault(theirs, metrics[ours])
    if "reward/mean" in metrics:  # verl's sequence reward: the score, minus the KL penalty when it is in the reward
        out.setdefault("critic/rewards/mean", metrics.get("reward/with_kl_mean", metrics["reward/mean"]))
    for name, value in metrics.items():
        match = _VAL_SOURCE.match(name)
        if match:
            kind = "acc" if match["kind"] == "acc" else "reward"
            out.setdefault(f"val-core/{match['source']}/{kind}/mean@{val_samples}", value)
    out.setdefault("training/global_step", float(step))
    return out
