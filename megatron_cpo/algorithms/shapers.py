"""Advantage shapers: what happens to the estimator's advantages (advantages.py) before the policy update: nothing,
or CPO's rule when `algorithm.adv_estimator=cpo` (registered in `ADVANTAGE_SHAPERS`).

A shaper says whether it needs hint contexts (`needs_hint_contexts`): the trainer builds the hinted prompts and runs
the hinted log-prob pass only for a shaper that asks for them, only for the responses it names (`hinted_responses`:
for CPO, those some term of the rule that reads a hint can select), and passes the resulting signals to `shape`. It
also says whether it reads the actor's log-probs or entropy (`needs_log_probs`): an on-policy update then shapes each
micro-batch from its own forward; otherwise they are computed before the update.

- every estimator of advantages.py (`grpo`, `rloo`, ...; DAPO and Dr.GRPO differ in the filters and the loss): its
  advantages as they are.
- `cpo`: CPO's hint-conditioned shaping rule `algorithm.cpo.wrap_method` (cpo.py, docs/cpo.md), weighted by
  `algorithm.cpo.{pos_alpha, neg_alpha}` with the hint ratio clamped to [1/cpo_lambda, cpo_lambda], applied to the
  advantages of the group estimator `algorithm.cpo.base_estimator` (`grpo`, `rloo` or
  `reinforce_plus_plus_baseline`: CPO's difficulty levels are read per prompt group; algorithms/config.py checks it).

Loading a config reads the shapers' names and flags (and checks `algorithm.cpo`), so this module imports no torch:
a shaper's math (cpo.py) loads when it first shapes a batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from megatron_cpo.algorithms.cpo_rules import known_rules

if TYPE_CHECKING:  # tensors, and the signals of the trainer's kernels.hint_mi_signals: annotations only
    import torch

    from megatron_cpo.kernels.hint_signals import HintSignals


@dataclass
class CPOConfig:
    """`algorithm.cpo.*`: CPO's settings (the seed's `algorithm.wrap_method`, `algorithm.gold_as_hint` and
    `actor_rollout_ref.actor.{cpo_lambda, pos_alpha, neg_alpha}` are accepted as aliases). Used when
    `algorithm.adv_estimator=cpo`.

    wrap_method: the shaping rule (docs/cpo.md, "The 18 shaping rules").
    gold_as_hint: show the data's worked solution as the hint (`data.hint_key`); off: no response gets a hint.
    cpo_lambda: the hint ratio is clamped to [1/cpo_lambda, cpo_lambda] (>= 1).
    pos_alpha / neg_alpha: the weights `a+` / `a-` of the rule's terms (0: the term does nothing).
    base_estimator: the group estimator whose advantages the rule shapes (`grpo`, `rloo`,
        `reinforce_plus_plus_baseline`; verl's `*_vectorized` spellings too).
    """

    wrap_method: str = "negonly_mi3"
    gold_as_hint: bool = True
    cpo_lambda: float = 5.0
    pos_alpha: float = 0.05
    neg_alpha: float = 0.1
    base_estimator: str = "grpo"

    def __post_init__(self) -> None:
        rules = known_rules()
        if self.wrap_method not in rules:
            raise ValueError(f"algorithm.cpo.wrap_method={self.wrap_method!r} is not a CPO shaping rule; choose one "
                             f"of {rules}")
        if self.cpo_lambda < 1:
            raise ValueError(f"algorithm.cpo.cpo_lambda={self.cpo_lambda} must be >= 1 (ratio clamp [1/lam, lam])")


class AdvantageShaper:
    """The estimator's advantages unchanged; subclasses shape them. `needs_hint_contexts`: whether `shape` reads hint
    signals (the trainer then builds hinted prompts for the responses `hinted_responses` names and scores them under
    those); `needs_log_probs`: whether it reads `log_probs` / `entropy` (None is passed otherwise).

    Shaping is per response: `response_inputs` computes, on the whole batch, what a response's shaping reads besides
    its own tokens (what depends on its prompt's other responses), and `shape_rows` then works on any subset of whole
    responses, e.g. each micro-batch of an on-policy update, whose own forward gives the log-probs
    (trainer/workers/shaping.py). `shape` is the two on the whole batch, with the step's metrics."""

    needs_hint_contexts: ClassVar[bool] = False
    needs_log_probs: ClassVar[bool] = False

    def response_inputs(self, correct: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        """Per-response tensors [N] for `shape_rows`, from each response's correctness and prompt group."""
        return {}

    def hinted_responses(self, correct: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """BoolTensor[N]: the responses whose advantages a hint can change (only these are scored under a hint)."""
        import torch

        return torch.zeros_like(correct, dtype=torch.bool)

    def shape_rows(self, advantages: torch.Tensor, *, mask: torch.Tensor, log_probs: torch.Tensor,
                   entropy: torch.Tensor, hint_log_probs: torch.Tensor | None, signals: HintSignals | None,
                   **response_inputs: torch.Tensor) -> torch.Tensor:
        """The shaped advantages of some whole responses (rows of every tensor, `response_inputs` included)."""
        return advantages

    def shape(self, advantages: torch.Tensor, *, mask: torch.Tensor, correct: torch.Tensor, group: torch.Tensor,
              log_probs: torch.Tensor, entropy: torch.Tensor, hint_log_probs: torch.Tensor | None = None,
              signals: HintSignals | None = None, hinted: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
        """(advantages to train on, metrics); all per-token tensors [N, T], `correct` / `group` [N]; `hinted` [N]:
        the responses scored under a hint (the others' `hint_log_probs` are their plain ones)."""
        return advantages, {}


class CPOShaper(AdvantageShaper):
    """CPO: the rule `config.wrap_method` moves the advantages of tokens the hint makes much more or less likely."""

    needs_hint_contexts: ClassVar[bool] = True
    needs_log_probs: ClassVar[bool] = True

    def __init__(self, config: CPOConfig) -> None:
        self.config = config

    def response_inputs(self, correct: torch.Tensor, group: torch.Tensor) -> dict[str, torch.Tensor]:
        from megatron_cpo.algorithms.cpo import difficulty_mask

        return {"correct": correct.bool(), "difficulty": difficulty_mask(correct.bool(), group, levels=3)}

    def hinted_responses(self, correct: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        from megatron_cpo.algorithms.cpo import hinted_responses

        cfg, inputs = self.config, self.response_inputs(correct, group)
        return hinted_responses(cfg.wrap_method, inputs["correct"], inputs["difficulty"], cfg.pos_alpha,
                                cfg.neg_alpha)

    def _shape(self, advantages, mask, log_probs, entropy, hint_log_probs, signals, correct, difficulty):
        from megatron_cpo.algorithms.cpo import shape_advantages

        if hint_log_probs is None or signals is None:
            raise ValueError("the cpo shaper needs hint_log_probs and the hint signals (kernels.hint_mi_signals)")
        cfg = self.config
        return shape_advantages(cfg.wrap_method, advantages, signals, entropy, mask.bool(), correct, difficulty,
                                log_probs, hint_log_probs, cfg.pos_alpha, cfg.neg_alpha, cfg.cpo_lambda)

    def shape_rows(self, advantages: torch.Tensor, *, mask: torch.Tensor, log_probs: torch.Tensor,
                   entropy: torch.Tensor, hint_log_probs: torch.Tensor | None, signals: HintSignals | None,
                   **response_inputs: torch.Tensor) -> torch.Tensor:
        return self._shape(advantages, mask, log_probs, entropy, hint_log_probs, signals, **response_inputs)[0]

    def shape(self, advantages: torch.Tensor, *, mask: torch.Tensor, correct: torch.Tensor, group: torch.Tensor,
              log_probs: torch.Tensor, entropy: torch.Tensor, hint_log_probs: torch.Tensor | None = None,
              signals: HintSignals | None = None, hinted: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, dict[str, float]]:
        import torch

        inputs = self.response_inputs(correct, group)
        shaped, metrics = self._shape(advantages, mask, log_probs, entropy, hint_log_probs, signals, **inputs)
        metrics.update(hint_signal_metrics(signals, mask.bool(), inputs["correct"],
                                           hinted if hinted is not None else torch.ones_like(inputs["correct"])))
        for level, name in ((-1, "all_wrong"), (0, "mixed"), (1, "all_correct")):
            metrics[f"cpo/difficulty_{name}"] = float((inputs["difficulty"] == level).float().mean())
        return shaped, metrics


def hint_signal_metrics(signals: HintSignals, mask: torch.Tensor, correct: torch.Tensor, hinted: torch.Tensor
                        ) -> dict[str, float]:
    """The hint's effect where it was measured: the share of responses scored under a hint (`cpo/hinted_frac`), and
    over their tokens the mean KL / MI, the MI's spread and sign, and its quantiles on right and on wrong responses
    (`cpo/mi_correct_p50`, ...). A statistic over no token is left out of the step's row."""
    import torch

    metrics = {"cpo/hinted_frac": float(hinted.float().mean()) if hinted.numel() else 0.0}
    on = mask & hinted[:, None]
    if on.any():
        mi = signals.mi[on]
        metrics.update({"cpo/mi_mean": float(mi.mean()), "cpo/kl_mean": float(signals.kl[on].mean()),
                        "cpo/mi_std": float(mi.std()) if mi.numel() > 1 else 0.0,
                        "cpo/mi_positive_ratio": float((mi > 0).float().mean())})
    for name, rows in (("correct", correct), ("wrong", ~correct)):
        values = signals.mi[on & rows[:, None]].float()
        if values.numel():
            quantiles = torch.quantile(values, torch.tensor([0.1, 0.5, 0.9]))
            metrics.update({f"cpo/mi_{name}_mean": float(values.mean()), f"cpo/mi_{name}_p10": float(quantiles[0]),
                            f"cpo/mi_{name}_p50": float(quantiles[1]), f"cpo/mi_{name}_p90": float(quantiles[2])})
    return metrics


ADVANTAGE_SHAPERS = {"cpo": CPOShaper}
"""`algorithm.adv_estimator` values that shape an estimator's advantages -> the shaper, built from `algorithm.cpo`
(adding a variant touches this table). Every other value is an estimator of advantages.py, left as it is."""


def build_shaper(adv_estimator: str, cpo: CPOConfig) -> AdvantageShaper:
    """The shaper `algorithm.adv_estimator` selects (none for a plain estimator)."""
    shaper = ADVANTAGE_SHAPERS.get(adv_estimator)
    return shaper(cpo) if shaper is not None else AdvantageShaper()
