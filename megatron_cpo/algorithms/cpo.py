"""CPO: hint-conditioned advantage shaping on top of GRPO (the full specification: docs/cpo.md).

The policy scores each sampled response twice: as sampled (`log_probs`) and with the gold solution in the context
(`hint_log_probs`). Where the hint makes a token much more (or less) likely, the token carries information the model
lacked; the shaping rules move the GRPO advantage of such tokens, weighted by the model's uncertainty.

The 18 rules of the reference are rows of data (`SHAPING_RULES`, cpo_rules.py): each rule is a few `Term`s, a term is
"on responses/tokens selected by these selectors, add alpha times the product of these signals, in this way", plus a
sign-clamp flag. Every term's change is computed from the GRPO advantage and the changes are summed; within each rule
the terms select disjoint tokens or only add, so this equals applying them one after another.

Differences from the reference code, all deliberate (docs/cpo.md, "Where we follow the specification"): the
difficulty mask has its intended meaning (the reference's was always 0); `wrong` is `not correct` (the reference
compared the score with 1 or -1 depending on the rule); the entropy max of the naive rules is taken over the
response's unmasked tokens (the reference also counted padding); every term selects through the mask, so whatever
the signals hold on padding is never read. With `hint_correct` (the
spec's `yw`), every term that selects wrong responses also requires it (the reference gated only some rules); terms
that act on any response (naive, noaccmask, mi, the difficulty rule) are not gated, as they do not look at
correctness.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from megatron_cpo.algorithms.cpo_rules import (
    HINT_READERS,
    RESPONSE_SELECTORS,
    SHAPING_RULES,
    CPOConfig,
    resolve_rule,
)
from megatron_cpo.algorithms.groups import check_group, group_count, group_sum

if TYPE_CHECKING:  # the signals come from the trainer's kernels.hint_mi_signals; no runtime import of kernels here
    from megatron_cpo.kernels.hint_signals import HintSignals

MI_CLAMP = 10.0
KL_CLAMP = 10.0
CONFIDENT_PROB = 0.1


def difficulty_mask(correct: torch.Tensor, group: torch.Tensor, levels: int = 3) -> torch.Tensor:
    """Difficulty of each response's prompt over its rollouts, LongTensor[N].

    levels=3: -1 every rollout wrong, +1 every rollout correct, 0 mixed.
    levels=5: by the count c of correct rollouts out of n: c = 0 -> -2, c <= n/4 -> -1, c < 3n/4 -> 0, c < n -> 1,
    c = n -> 2.
    """
    if correct.dim() != 1:
        raise ValueError(f"correct has shape {tuple(correct.shape)}; pass one bool per response, shape (N,)")
    check_group(group, correct.shape[0])
    n = group_count(group)[group]
    c = group_sum(correct.long(), group)[group]
    if levels == 3:
        return torch.where(c == 0, -1, torch.where(c == n, 1, 0)).long()
    if levels == 5:
        level = torch.where(c < n, 1, 2)
        level = torch.where(4 * c < 3 * n, 0, level)
        level = torch.where(4 * c <= n, -1, level)
        return torch.where(c == 0, -2, level).long()
    raise ValueError(f"difficulty levels={levels} is not supported; use 3 (-1/0/+1) or 5 (-2..2)")


@dataclass(frozen=True)
class ShapingInputs:
    """What a shaping rule reads of some whole responses (the step batch's, or one micro-batch's rows of it).

    Per token, [N, T]: the estimator's `advantages`, the `mask`, the actor's `log_probs` and `entropy`, the
    `hint_log_probs` (a response not scored under a hint has its plain log-probs there) and their `signals`
    (`kernels.hint_mi_signals`). Per response, [N]: `correct`, its prompt's 3-level `difficulty` (`difficulty_mask`,
    read on the whole batch) and optionally `hint_correct`, whether a hinted rollout of the same prompt was correct
    (terms on wrong responses then also require it)."""

    advantages: torch.Tensor
    mask: torch.Tensor
    log_probs: torch.Tensor
    entropy: torch.Tensor
    hint_log_probs: torch.Tensor | None
    signals: HintSignals | None
    correct: torch.Tensor
    difficulty: torch.Tensor
    hint_correct: torch.Tensor | None = None


class _Responses:
    """What a rule reads of each response before any log-prob pass: its correctness and its prompt's difficulty."""

    def __init__(self, correct, difficulty, hint_correct):
        self.correct, self.difficulty = correct.bool()[:, None], difficulty[:, None]
        self.hint_correct = None if hint_correct is None else hint_correct.bool()[:, None]

    def wrong(self) -> torch.Tensor:
        wrong = ~self.correct
        return wrong if self.hint_correct is None else wrong & self.hint_correct


class _Inputs(_Responses):
    """The tensors a rule reads, with the selectors and factors it names computed on demand."""

    def __init__(self, inputs: ShapingInputs, cpo_lambda: float) -> None:
        super().__init__(inputs.correct, inputs.difficulty, inputs.hint_correct)
        self.advantages, self.signals, self.entropy = inputs.advantages, inputs.signals, inputs.entropy
        self.mask, self.log_probs, self.hint_log_probs = inputs.mask.bool(), inputs.log_probs, inputs.hint_log_probs
        self.cpo_lambda = cpo_lambda

    def hint_ratio(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`clamp(p_hint / p, 1/lam, lam)` and lam as a tensor of the same dtype, so that the bound tests are exact."""
        lam = torch.tensor(self.cpo_lambda, dtype=self.log_probs.dtype, device=self.log_probs.device)
        return torch.exp(self.hint_log_probs - self.log_probs).clamp(1.0 / lam, lam), lam

    def entropy_gap(self) -> torch.Tensor:
        h_max = self.entropy.masked_fill(~self.mask, float("-inf")).amax(-1, keepdim=True)
        return torch.where(self.mask, h_max - self.entropy, torch.zeros_like(self.entropy))


def _hint_raises(x: _Inputs) -> torch.Tensor:
    ratio, lam = x.hint_ratio()
    return (ratio >= lam) & (torch.exp(x.hint_log_probs) > CONFIDENT_PROB)


def _hint_lowers(x: _Inputs) -> torch.Tensor:
    ratio, lam = x.hint_ratio()
    return (ratio <= 1.0 / lam) & (torch.exp(x.log_probs) > CONFIDENT_PROB)


SELECTORS: dict[str, Callable[[_Inputs], torch.Tensor]] = {
    "correct": lambda x: x.correct,
    "wrong": _Responses.wrong,
    "all_wrong": lambda x: x.difficulty == -1,
    "all_correct": lambda x: x.difficulty == 1,
    "mixed": lambda x: x.difficulty == 0,
    "not_all_wrong": lambda x: x.difficulty != -1,
    "not_all_correct": lambda x: x.difficulty != 1,
    "not_mixed": lambda x: x.difficulty != 0,
    "mi_nonneg": lambda x: x.signals.mi >= 0,
    "mi_neg": lambda x: x.signals.mi < 0,
    "hint_raises": _hint_raises,
    "hint_lowers": _hint_lowers,
}

FACTORS: dict[str, Callable[[_Inputs], torch.Tensor]] = {
    "H": lambda x: x.entropy,
    "H_gap": _Inputs.entropy_gap,
    "u": lambda x: x.signals.u,
    "1-u": lambda x: 1.0 - x.signals.u,
    "1+u": lambda x: 1.0 + x.signals.u,
    "2-u": lambda x: 2.0 - x.signals.u,
    "mi": lambda x: x.signals.mi,
    "mi_clamped": lambda x: x.signals.mi.clamp(max=MI_CLAMP),
    "kl_clamped": lambda x: x.signals.kl.clamp(-KL_CLAMP, KL_CLAMP),
    "s": lambda x: x.signals.s[:, None],
    "ubar": lambda x: x.signals.ubar[:, None],
}

APPLY: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "add": lambda change, a: change,
    "sub": lambda change, a: -change,
    "add_floor_half_abs": lambda change, a: torch.maximum(change, -a.abs() / 2),
    "add_cap_half_abs": lambda change, a: torch.minimum(change, a.abs() / 2),
}


def _check_rule_table() -> None:
    """Fail at import, naming the part, if a rule refers to a selector, factor, alpha or apply that does not exist,
    or the table of what each name reads (cpo_rules.py) names one that does not exist."""
    undeclared = sorted((RESPONSE_SELECTORS - set(SELECTORS)) | (HINT_READERS - set(SELECTORS) - set(FACTORS)))
    if undeclared:
        raise ValueError(f"cpo_rules.RESPONSE_SELECTORS / HINT_READERS name unknown parts {undeclared}")
    for rule in SHAPING_RULES.values():
        for term in rule.terms:
            unknown = ([s for s in term.where if s not in SELECTORS] + [f for f in term.factors if f not in FACTORS]
                       + ([term.apply] if term.apply not in APPLY else [])
                       + ([term.alpha] if term.alpha not in ("pos", "neg") else []))
            if unknown:
                raise ValueError(f"shaping rule {rule.name!r} names unknown parts {unknown}")


_check_rule_table()


def _check_shaping_inputs(inputs: ShapingInputs) -> None:
    signals, difficulty = inputs.signals, inputs.difficulty
    shape = tuple(inputs.advantages.shape)
    for name, tensor in (("signals.mi", signals.mi), ("signals.kl", signals.kl), ("signals.u", signals.u),
                         ("entropy", inputs.entropy), ("mask", inputs.mask), ("log_probs", inputs.log_probs),
                         ("hint_log_probs", inputs.hint_log_probs)):
        if tuple(tensor.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected {shape} like advantages")
    for name, tensor in (("signals.ubar", signals.ubar), ("signals.s", signals.s), ("correct", inputs.correct),
                         ("difficulty", difficulty), ("hint_correct", inputs.hint_correct)):
        if tensor is not None and tuple(tensor.shape) != shape[:1]:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}; expected ({shape[0]},), one per response")
    if difficulty.numel() and (int(difficulty.min()) < -1 or int(difficulty.max()) > 1):
        raise ValueError(
            f"difficulty holds values in [{int(difficulty.min())}, {int(difficulty.max())}]; the shaping rules read "
            "the 3-level mask (-1/0/+1): pass difficulty_mask(correct, group, levels=3)"
        )


def hinted_responses(rule_name: str, correct: torch.Tensor, difficulty: torch.Tensor, pos_alpha: float | None,
                     neg_alpha: float | None, hint_correct: torch.Tensor | None = None) -> torch.Tensor:
    """The responses whose advantages the rule can change through a hint signal, BoolTensor[N]: those that the
    response selectors of some term reading the hint pick, over the terms whose alpha is not 0.

    `shape_advantages` reads `hint_log_probs` (and the signals made from them) only through such terms, on the tokens
    of the responses they select, so the hinted pass need only score these responses: any value on the other rows
    (e.g. the plain log-probs, as for a response without a hint) gives bit-identical advantages. With `negonly_mi3`
    only wrong responses of all-wrong prompts qualify, so on filter-groups batches (no all-wrong prompts) none does.
    """
    rule = resolve_rule(rule_name)
    responses = _Responses(correct, difficulty, hint_correct)
    alphas = {"pos": pos_alpha or 0.0, "neg": neg_alpha or 0.0}
    hinted = torch.zeros_like(responses.correct)
    for term in rule.terms:
        if alphas[term.alpha] == 0.0 or not term.reads_hint:
            continue
        where = torch.ones_like(hinted)
        for selector in term.response_selectors:
            where = where & SELECTORS[selector](responses)
        hinted = hinted | where
    return hinted[:, 0]


def shape_advantages(config: CPOConfig, inputs: ShapingInputs) -> torch.Tensor:
    """The token-level advantages of `inputs` under CPO's rule `config.wrap_method`, weighted by `config.pos_alpha` /
    `neg_alpha`, with the hint ratio clamped to [1/cpo_lambda, cpo_lambda] (the config checked cpo_lambda >= 1).
    Values on padding are returned unchanged. Nothing here needs gradients."""
    rule = resolve_rule(config.wrap_method)
    _check_shaping_inputs(inputs)
    assert config.cpo_lambda >= 1.0, "CPOConfig refuses algorithm.cpo.cpo_lambda < 1"
    with torch.no_grad():
        x = _Inputs(inputs, config.cpo_lambda)
        alphas = {"pos": config.pos_alpha or 0.0, "neg": config.neg_alpha or 0.0}
        change = torch.zeros_like(x.advantages)
        for term in rule.terms:
            if alphas[term.alpha] == 0.0:
                continue
            where = x.mask
            for selector in term.where:
                where = where & SELECTORS[selector](x)
            value = alphas[term.alpha] * FACTORS[term.factors[0]](x)
            for factor in term.factors[1:]:
                value = value * FACTORS[factor](x)
            change = change + torch.where(where, APPLY[term.apply](value, x.advantages), torch.zeros_like(change))
        shaped = x.advantages + change
        if rule.sign_clamp:
            restored = torch.where(x.correct, shaped.clamp(min=0), shaped.clamp(max=0))
            shaped = torch.where(x.mask, restored, shaped)
    return shaped


def shaping_metrics(inputs: ShapingInputs, shaped: torch.Tensor) -> dict[str, float]:
    """What the rule did over the tokens of `inputs`: the mean change of the advantages (`cpo/adv_change_mean`), the
    share of tokens it changed (`cpo/shaped_token_frac`) and the mean uncertainty `u` (`cpo/u_mean`)."""
    mask = inputs.mask.bool()
    tokens = mask.sum().clamp(min=1)

    def masked_mean(values: torch.Tensor) -> float:
        return float(torch.where(mask, values, 0.0).sum() / tokens)

    return {"cpo/adv_change_mean": masked_mean(shaped - inputs.advantages),
            "cpo/shaped_token_frac": float(((shaped != inputs.advantages) & mask).sum() / tokens),
            "cpo/u_mean": masked_mean(inputs.signals.u)}
