"""Advantage shapers: what happens to the estimator's advantages (advantages.py) before the policy update: nothing,
or CPO's rule when `algorithm.adv_estimator=cpo` (registered in `ADVANTAGE_SHAPERS`).

A shaper says whether it needs hint contexts (`needs_hint_contexts`): the trainer builds the hinted prompts and runs
the hinted log-prob pass only for a shaper that asks for them, only for the responses it names (`hinted_responses`:
for CPO, those some term of the rule that reads a hint can select), and passes the resulting signals to `shape` in
its typed inputs (cpo.py's `ShapingInputs`). It also says whether it reads the actor's log-probs or entropy
(`needs_log_probs`): an on-policy update then shapes each micro-batch from its own forward; otherwise they are
computed before the update. The trainer applies it in one place, trainer/workers/shaping.py.

- every estimator of advantages.py (`grpo`, `rloo`, ...; DAPO and Dr.GRPO differ in the filters and the loss): its
  advantages as they are.
- `cpo`: CPO's hint-conditioned shaping rule `algorithm.cpo.wrap_method` (cpo.py, docs/cpo.md), weighted by
  `algorithm.cpo.{pos_alpha, neg_alpha}` with the hint ratio clamped to [1/cpo_lambda, cpo_lambda], applied to the
  advantages of the group estimator `algorithm.cpo.base_estimator` (`grpo`, `rloo` or
  `reinforce_plus_plus_baseline`: CPO's difficulty levels are read per prompt group; algorithms/config.py checks it).

Loading a config reads the shapers' names and flags (and checks `algorithm.cpo`: `CPOConfig`, cpo_rules.py), so this
module imports no torch: a shaper's math (cpo.py) loads when it first shapes a batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from megatron_cpo.algorithms.cpo_rules import CPOConfig

if TYPE_CHECKING:  # tensors, CPO's inputs and the signals of the trainer's kernels.hint_mi_signals: annotations only
    import torch

    from megatron_cpo.algorithms.cpo import ShapingInputs
    from megatron_cpo.kernels.hint_signals import HintSignals


@dataclass(frozen=True)
class ResponseInputs:
    """What a shaper reads of each response besides its tokens, [N] each: its correctness and its prompt's 3-level
    difficulty (-1 all wrong, 0 mixed, +1 all correct), read on the whole batch since it depends on the prompt's other
    responses."""

    correct: torch.Tensor
    difficulty: torch.Tensor


class AdvantageShaper:
    """The estimator's advantages unchanged; subclasses shape them. `needs_hint_contexts`: whether `shape` reads hint
    signals (the trainer then builds hinted prompts for the responses `hinted_responses` names and scores them under
    those); `needs_log_probs`: whether it reads the actor's log-probs / entropy.

    Shaping is per response: `response_inputs` computes, on the whole batch, what a response's shaping reads besides
    its own tokens, and `shape` then works on any rows of whole responses (`ShapingInputs`), e.g. each micro-batch
    of an on-policy update, whose own forward gives the log-probs (trainer/workers/shaping.py). `metrics` reads the
    whole batch's inputs and shaped advantages."""

    needs_hint_contexts: ClassVar[bool] = False
    needs_log_probs: ClassVar[bool] = False

    def response_inputs(self, correct: torch.Tensor, group: torch.Tensor) -> ResponseInputs:
        """Each response's correctness and its prompt's difficulty, from its correctness and prompt group."""
        from megatron_cpo.algorithms.cpo import difficulty_mask

        return ResponseInputs(correct.bool(), difficulty_mask(correct.bool(), group, levels=3))

    def hinted_responses(self, correct: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        """BoolTensor[N]: the responses whose advantages a hint can change (only these are scored under a hint)."""
        import torch

        return torch.zeros_like(correct, dtype=torch.bool)

    def shape(self, inputs: ShapingInputs) -> torch.Tensor:
        """The advantages to train on of the responses of `inputs`, [N, T]."""
        return inputs.advantages

    def metrics(self, inputs: ShapingInputs, shaped: torch.Tensor, hinted: torch.Tensor | None = None
                ) -> dict[str, float]:
        """The step's metrics of the shaping, from the whole batch's inputs and shaped advantages; `hinted` [N]: the
        responses scored under a hint (None: all of them)."""
        return {}


class CPOShaper(AdvantageShaper):
    """CPO: the rule `config.wrap_method` moves the advantages of tokens the hint makes much more or less likely."""

    needs_hint_contexts: ClassVar[bool] = True
    needs_log_probs: ClassVar[bool] = True

    def __init__(self, config: CPOConfig) -> None:
        self.config = config

    def hinted_responses(self, correct: torch.Tensor, group: torch.Tensor) -> torch.Tensor:
        from megatron_cpo.algorithms.cpo import hinted_responses

        cfg, responses = self.config, self.response_inputs(correct, group)
        return hinted_responses(cfg.wrap_method, responses.correct, responses.difficulty, cfg.pos_alpha,
                                cfg.neg_alpha)

    def shape(self, inputs: ShapingInputs) -> torch.Tensor:
        from megatron_cpo.algorithms.cpo import shape_advantages

        if inputs.hint_log_probs is None or inputs.signals is None:
            raise ValueError("the cpo shaper needs hint_log_probs and the hint signals (kernels.hint_mi_signals)")
        return shape_advantages(self.config, inputs)

    def metrics(self, inputs: ShapingInputs, shaped: torch.Tensor, hinted: torch.Tensor | None = None
                ) -> dict[str, float]:
        import torch

        from megatron_cpo.algorithms.cpo import shaping_metrics

        metrics = shaping_metrics(inputs, shaped)
        metrics.update(hint_signal_metrics(inputs.signals, inputs.mask.bool(), inputs.correct,
                                           hinted if hinted is not None else torch.ones_like(inputs.correct)))
        for level, name in ((-1, "all_wrong"), (0, "mixed"), (1, "all_correct")):
            metrics[f"cpo/difficulty_{name}"] = float((inputs.difficulty == level).float().mean())
        return metrics


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
