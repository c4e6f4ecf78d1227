"""Math graders: MATH-style equivalence (exact, numeric, symbolic) and strict AIME/AMC matching.

Equivalence is decided in three stages, cheapest first: the normalised strings match (``strip_string``); both sides
are plain numbers that agree within a relative tolerance; HF math-verify (sympy based) finds them symbolically equal
(sets, intervals, matrices, roots, pi, expressions). math-verify bounds each parse and comparison with
``signal.alarm``, which only works on the main thread: there the symbolic stage gets ``symbolic_timeout_s``; on other
threads it runs without an alarm, and the hard bound is the reward manager's per-sample timeout, which kills the
worker process (``megatron_cpo.rewards.manager``).

Scores follow CPO's convention, +1 correct / -1 wrong; pass ``wrong_score=0.0`` for 1/0.
"""
from __future__ import annotations

import math
import re
import threading

from math_verify import parse as mv_parse
from math_verify import verify as mv_verify

from megatron_cpo.rewards.math_answer import extract_answer, strip_string

MAX_SYMBOLIC_CHARS = 400
_INTEGER = re.compile(r"^-?\d+$")
_FRACTION = re.compile(r"^(-?)\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}$")
_SCIENTIFIC = re.compile(r"^(-?[\d.]+)\\(?:times|cdot)10\^\{?(-?\d+)\}?$")


def numeric_value(normalised: str) -> float | None:
    """The value of a normalised answer that is a plain number, fraction or scientific literal, else None."""
    text = normalised
    try:
        return float(text)
    except ValueError:
        pass
    fraction = _FRACTION.match(text)
    if fraction:
        denominator = float(fraction.group(3))
        if denominator == 0:
            return None
        value = float(fraction.group(2)) / denominator
        return -value if fraction.group(1) else value
    scientific = _SCIENTIFIC.match(text)
    if scientific:
        return float(scientific.group(1)) * 10.0 ** int(scientific.group(2))
    return None


def _symbolic_equal(prediction: str, ground_truth: str, timeout_s: float) -> bool:
    """math-verify equivalence of two LaTeX answers, under an alarm when on the main thread."""
    on_main_thread = threading.current_thread() is threading.main_thread()
    seconds = max(1, int(math.ceil(timeout_s))) if on_main_thread else None
    gold = mv_parse("\\boxed{" + ground_truth + "}", parsing_timeout=seconds)
    predicted = mv_parse("\\boxed{" + prediction + "}", parsing_timeout=seconds)
    if not gold or not predicted:
        return False
    return bool(mv_verify(gold, predicted, timeout_seconds=seconds))


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
        if math.isclose(predicted_value, true_value, rel_tol=1e-6, abs_tol=1e-9):
            return True, "numeric"
        return False, f"numeric mismatch: {predicted_value!r} != {true_value!r}"
    if len(prediction) > MAX_SYMBOLIC_CHARS or len(ground_truth) > MAX_SYMBOLIC_CHARS:
        return False, f"answer longer than {MAX_SYMBOLIC_CHARS} characters; symbolic check skipped"
    if _symbolic_equal(str(prediction), str(ground_truth), symbolic_timeout_s):
        return True, "symbolic"
    return False, f"not equivalent: {normalised_prediction!r} vs {normalised_truth!r}"


def _result(correct: bool, prediction: str | None, how: str, wrong_score: float) -> dict:
    result = {"score": 1.0 if correct else float(wrong_score), "acc": correct, "pred": prediction}
    result["method" if correct else "reason"] = how
    return result


def compute_math_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = -1.0, symbolic_timeout_s: float = 5.0,
) -> dict:
    """MATH-style grade (hendrycks_math, math500, the synthetic arithmetic task): +1 if equivalent else wrong_score."""
    prediction = extract_answer(solution_str)
    correct, how = math_equivalent(prediction, str(ground_truth), symbolic_timeout_s)
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
    both_integers = _INTEGER.match(normalised_prediction) and _INTEGER.match(normalised_truth)
    if normalised_prediction == normalised_truth or (both_integers and int(normalised_prediction) == int(
            normalised_truth)):
        return _result(True, prediction, "exact", wrong_score)
    return _result(False, prediction, f"strict mismatch: {normalised_prediction!r} vs {normalised_truth!r}",
                   wrong_score)
