"""Math graders: MATH-style equivalence (exact, numeric, symbolic) and strict AIME/AMC matching.

Cheapest first: normalised strings, then plain numbers (exact decimals), then math-verify under a CPU-time budget,
skipped for inputs that would hang sympy in one C call. Scores are CPO's +1 / -1; ``wrong_score=0.0`` gives 1/0.
"""
from __future__ import annotations

import decimal
import re
import threading

from megatron_cpo.rewards.math_answer import extract_answer, last_boxed, strip_string
from megatron_cpo.rewards.symbolic import SymbolicTimeout, symbolic_equal

MAX_SYMBOLIC_CHARS = 400
INTEGER = re.compile(r"^[-+]?\d+$")
_PLAIN_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
_NUMBER_LITERAL = re.compile(rf"^{_PLAIN_NUMBER}(?:[eE][-+]?\d{{1,6}})?$")
_FRACTION = re.compile(rf"^(-?)\\frac\{{({_PLAIN_NUMBER})\}}\{{({_PLAIN_NUMBER})\}}$")
_SCIENTIFIC = re.compile(rf"^({_PLAIN_NUMBER})\\(?:times|cdot)10\^\{{?([-+]?\d{{1,6}})\}}?$")
# Inputs sympy cannot finish in bounded time inside one C call (where no signal can interrupt it): exponents or
# factorials of 4+ digit numbers, and towers of powers. The symbolic stage is skipped for them.
_EXPLOSIVE = re.compile(r"\^\s*\{?\s*[-+]?\d{4,}|\d{4,}\s*!|\^\s*\{[^{}]*\^|\^\s*\d+\s*\^")
_NUMERIC_CONTEXT = decimal.Context(prec=60, Emax=decimal.MAX_EMAX, Emin=decimal.MIN_EMIN, traps=[])


def numeric_value(normalised: str) -> decimal.Decimal | None:
    """The exact value of a normalised answer that is a plain number, fraction or scientific literal, else None.

    Decimal, not float: ``1e999`` and ``1e500`` are different numbers (as floats both are inf), ``10^{400}`` does not
    overflow, and malformed literals such as ``1.2.3`` are simply not numbers.
    """
    text = normalised
    if _NUMBER_LITERAL.match(text):
        return _NUMERIC_CONTEXT.create_decimal(text)
    fraction = _FRACTION.match(text)
    if fraction:
        denominator = _NUMERIC_CONTEXT.create_decimal(fraction.group(3))
        if denominator == 0:
            return None
        value = _NUMERIC_CONTEXT.divide(_NUMERIC_CONTEXT.create_decimal(fraction.group(2)), denominator)
        return -value if fraction.group(1) else value
    scientific = _SCIENTIFIC.match(text)
    if scientific:
        return _NUMERIC_CONTEXT.create_decimal(scientific.group(1)).scaleb(int(scientific.group(2)), _NUMERIC_CONTEXT)
    return None


def numbers_close(first: decimal.Decimal, second: decimal.Decimal, rel_tol: float, abs_tol: float) -> bool:
    """``math.isclose`` for exact decimals of any magnitude (no overflow, no inf == inf)."""
    context = _NUMERIC_CONTEXT
    difference = context.abs(context.subtract(first, second))
    scale = context.max(context.abs(first), context.abs(second))
    tolerance = context.max(context.multiply(context.create_decimal(repr(rel_tol)), scale),
                            context.create_decimal(repr(abs_tol)))
    return difference <= tolerance


def integers_equal(first: str, second: str) -> bool:
    """Two integer literals (``INTEGER``) are the same number, compared as text: no int() digit limit."""
    def canonical(text: str) -> str:
        sign = "-" if text.startswith("-") else ""
        digits = text.lstrip("+-").lstrip("0") or "0"
        return ("" if digits == "0" else sign) + digits
    return canonical(first) == canonical(second)


def math_equivalent(prediction: str | None, ground_truth: str, symbolic_timeout_s: float = 5.0) -> tuple[bool, str]:
    """Whether ``prediction`` equals ``ground_truth``; the second item names the stage that decided or why not."""
    if prediction is None or not str(prediction).strip():
        return False, "no answer found in the response"
    normalised_prediction, normalised_truth = strip_string(prediction), strip_string(ground_truth)
    if not normalised_prediction:
        return False, "empty answer after normalisation"
    if normalised_prediction == normalised_truth:
        return True, "exact"
    predicted_value, true_value = numeric_value(normalised_prediction), numeric_value(normalised_truth)
    if predicted_value is not None and true_value is not None:
        if numbers_close(predicted_value, true_value, rel_tol=1e-6, abs_tol=1e-9):
            return True, "numeric"
        return False, f"numeric mismatch: {predicted_value} != {true_value}"
    if len(prediction) > MAX_SYMBOLIC_CHARS or len(ground_truth) > MAX_SYMBOLIC_CHARS:
        return False, f"answer longer than {MAX_SYMBOLIC_CHARS} characters; symbolic check skipped"
    if _EXPLOSIVE.search(prediction) or _EXPLOSIVE.search(ground_truth):
        return False, "huge exponent or factorial; symbolic check skipped"
    if threading.current_thread() is not threading.main_thread():
        from megatron_cpo.rewards.symbolic_process import symbolic_equal_in_helper

        equal, why_not = symbolic_equal_in_helper(str(prediction), str(ground_truth), symbolic_timeout_s)
        if equal:
            return True, "symbolic"
        return False, why_not or f"not equivalent: {normalised_prediction!r} vs {normalised_truth!r}"
    try:
        if symbolic_equal(str(prediction), str(ground_truth), symbolic_timeout_s):
            return True, "symbolic"
    except SymbolicTimeout as timeout:
        return False, str(timeout)
    return False, f"not equivalent: {normalised_prediction!r} vs {normalised_truth!r}"


def _result(correct: bool, prediction: str | None, how: str, wrong_score: float) -> dict:
    result = {"score": 1.0 if correct else float(wrong_score), "acc": correct, "pred": prediction}
    result["method" if correct else "reason"] = how
    return result


def compute_math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = -1.0, symbolic_timeout_s: float = 5.0, require_boxed: bool = False,
) -> dict:
    """MATH-style grade: +1 if the final answer is equivalent to the ground truth, else ``wrong_score``.

    The final answer is the last ``\\boxed{}``; without one, the announced answer or the last number unless
    ``require_boxed`` (verl's lighteval/MATH rule: no box, no credit).
    """
    prediction = last_boxed(solution_str) if require_boxed and isinstance(solution_str, str) else (
        None if require_boxed else extract_answer(solution_str))
    correct, how = math_equivalent(prediction, str(ground_truth), symbolic_timeout_s)
    if prediction is None and require_boxed:
        how = "no \\boxed{} answer found"
    return _result(correct, prediction, how, wrong_score)


def compute_strict_math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = -1.0,
) -> dict:
    """AIME/AMC grade: the normalised strings must match exactly (answers are integers, no symbolic slack)."""
    prediction = extract_answer(solution_str)
    if prediction is None:
        return _result(False, None, "no answer found in the response", wrong_score)
    normalised_prediction, normalised_truth = strip_string(prediction), strip_string(str(ground_truth))
    both_integers = INTEGER.match(normalised_prediction) and INTEGER.match(normalised_truth)
    if normalised_prediction == normalised_truth or (both_integers and integers_equal(normalised_prediction,
                                                                                     normalised_truth)):
        return _result(True, prediction, "exact", wrong_score)
    return _result(False, prediction, f"strict mismatch: {normalised_prediction!r} vs {normalised_truth!r}",
                   wrong_score)
