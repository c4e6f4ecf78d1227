"""CPO's settings (`algorithm.cpo`, `CPOConfig`) and its 18 shaping rules as rows of data (docs/cpo.md, "The 18
shaping rules"), torch-free so that a config can name its rule without loading torch; cpo.py evaluates them.

A rule is a few `Term`s, a term is "on responses/tokens selected by these selectors, add alpha times the product of
these signals, in this way", plus a sign-clamp flag. Selectors, factors and ways of applying are named here and
implemented in cpo.py (`SELECTORS`, `FACTORS`, `APPLY`), which checks at import that every name a rule uses exists.

What each name reads is data too: `RESPONSE_SELECTORS` read only a response's correctness and its prompt's difficulty
(known before any log-prob pass), `HINT_READERS` read the hinted log-probs. A term that names no hint reader changes
an advantage without the hint, so a response is scored under its hint only when some term that does read it can
select the response (`Term.reads_hint`, `Term.response_selectors`; cpo.py `hinted_responses`).
"""
from dataclasses import dataclass

LEGACY_SUFFIX = "_qwen3"

RESPONSE_SELECTORS = frozenset({"correct", "wrong", "all_wrong", "all_correct", "mixed", "not_all_wrong",
                                "not_all_correct", "not_mixed"})
"""Selectors that hold for whole responses: they read the response's correctness and its prompt's difficulty only."""
HINT_READERS = frozenset({"mi_nonneg", "mi_neg", "hint_raises", "hint_lowers", "mi", "mi_clamped", "kl_clamped", "s"})
"""Selectors and factors that read the hinted log-probs (through mi, kl, s or the hint ratio); the others read
correctness, difficulty and the plain pass's entropy (H, H_gap, u, ubar)."""


@dataclass(frozen=True)
class Term:
    """One part of a shaping rule: on tokens where all `where` selectors hold, change A by
    `apply(alpha * prod(factors), A)`. `alpha` is "pos" (pos_alpha) or "neg" (neg_alpha)."""

    alpha: str
    where: tuple[str, ...]
    factors: tuple[str, ...]
    apply: str = "add"

    @property
    def reads_hint(self) -> bool:
        """Whether the term's change depends on the hinted log-probs (a selector or a factor reads them)."""
        return any(name in HINT_READERS for name in self.where + self.factors)

    @property
    def response_selectors(self) -> tuple[str, ...]:
        """The term's selectors that pick whole responses; its other selectors pick tokens within them."""
        return tuple(name for name in self.where if name in RESPONSE_SELECTORS)


@dataclass(frozen=True)
class ShapingRule:
    """A named shaping rule: its terms and whether the GRPO sign is restored afterwards (sign clamp)."""

    name: str
    terms: tuple[Term, ...]
    sign_clamp: bool


def _mi3_wrong(where: tuple[str, ...] = ("wrong",), apply: str = "add", negative_part: bool = True) -> tuple:
    """The wrong-response half of the mi3 family: mi * u where mi >= 0, mi * (1 - u) where mi < 0."""
    terms = (Term("neg", where + ("mi_nonneg",), ("mi", "u"), apply),)
    if negative_part:
        terms += (Term("neg", where + ("mi_neg",), ("mi", "1-u"), apply),)
    return terms


_BONUS_U = Term("pos", ("correct",), ("u",))
_NAIVE = (Term("pos", ("hint_raises",), ("H",)), Term("neg", ("hint_lowers",), ("H_gap",), "sub"))

SHAPING_RULES: dict[str, ShapingRule] = {rule.name: rule for rule in (
    ShapingRule("naive", _NAIVE, sign_clamp=False),
    ShapingRule("naive_qwen3", (Term("pos", ("correct", "hint_raises"), ("H",)),
                                Term("neg", ("wrong", "hint_lowers"), ("H_gap",), "sub")), sign_clamp=True),
    ShapingRule("noaccmask_qwen3", _NAIVE, sign_clamp=True),
    ShapingRule("mi_qwen3", (Term("pos", ("mi_nonneg",), ("mi", "u")),
                             Term("neg", ("mi_neg",), ("mi", "1-u"))), sign_clamp=True),
    ShapingRule("mi_accmask_qwen3", (Term("pos", ("correct", "mi_nonneg"), ("mi", "1+u")),
                                     Term("neg", ("wrong", "mi_neg"), ("mi", "2-u"))), sign_clamp=True),
    ShapingRule("mi_unify_qwen3", (Term("pos", ("correct",), ("mi", "1-u")),
                                   Term("neg", ("wrong",), ("mi", "1-u"))), sign_clamp=True),
    ShapingRule("mi_clamp_unify_qwen3", (Term("pos", ("correct",), ("mi_clamped", "1-u")),
                                         Term("neg", ("wrong",), ("mi_clamped", "1-u"))), sign_clamp=True),
    ShapingRule("mi_clamp_unify_difficulty_qwen3", (Term("pos", ("not_mixed",), ("mi_clamped", "1-u")),
                                                    Term("neg", ("mixed",), ("mi_clamped", "1-u"))), sign_clamp=False),
    ShapingRule("mi3_qwen3", (_BONUS_U,) + _mi3_wrong(), sign_clamp=False),
    ShapingRule("negonly_mi3_qwen3", (_BONUS_U,) + _mi3_wrong(("wrong", "all_wrong")), sign_clamp=False),
    ShapingRule("negonly_mi_qwen3", (_BONUS_U, Term("neg", ("wrong", "all_wrong"), ("mi",))), sign_clamp=False),
    ShapingRule("reverse_mi3_qwen3", (_BONUS_U,) + _mi3_wrong(apply="sub"), sign_clamp=False),
    ShapingRule("addition_mi3_qwen3", (_BONUS_U,) + _mi3_wrong(negative_part=False), sign_clamp=False),
    ShapingRule("mi2_qwen3", (_BONUS_U, Term("neg", ("wrong",), ("mi",))), sign_clamp=False),
    ShapingRule("negonly_seq_kl_qwen3", (Term("pos", ("correct",), ("s",)),
                                         Term("neg", ("wrong", "all_wrong"), ("s",))), sign_clamp=False),
    ShapingRule("seq_kl_qwen3", (Term("pos", ("correct", "all_correct"), ("ubar",)),
                                 Term("pos", ("correct", "not_all_correct"), ("ubar",), "add_floor_half_abs"),
                                 Term("neg", ("wrong", "all_wrong"), ("s",)),
                                 Term("neg", ("wrong", "not_all_wrong"), ("s",), "add_cap_half_abs")),
                sign_clamp=False),
    ShapingRule("negonly_tok_kl_qwen3", (_BONUS_U, Term("neg", ("wrong", "all_wrong"), ("kl_clamped",))),
                sign_clamp=False),
    ShapingRule("tok_kl_qwen3", (_BONUS_U, Term("neg", ("wrong", "all_wrong"), ("kl_clamped",)),
                                 Term("neg", ("wrong", "not_all_wrong"), ("kl_clamped",), "add_cap_half_abs")),
                sign_clamp=False),
)}


def known_rules() -> list[str]:
    """Every accepted rule name: the spec's names and the same names without the historical `_qwen3` suffix."""
    short = {name.removesuffix(LEGACY_SUFFIX) for name in SHAPING_RULES} - set(SHAPING_RULES)
    return sorted(set(SHAPING_RULES) | short)


def resolve_rule(name: str) -> ShapingRule:
    """Look a rule up by name; the exact name wins (`naive` and `naive_qwen3` are different rules), else the name
    with the `_qwen3` suffix added."""
    rule = SHAPING_RULES.get(name) or SHAPING_RULES.get(name + LEGACY_SUFFIX)
    if rule is None:
        raise ValueError(f"unknown CPO shaping rule (algorithm.wrap_method) {name!r}; known rules: {known_rules()}")
    return rule


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
