"""Graders for short final answers: GSM8K numbers, GPQA multiple choice letters, Geometry3K numeric values, and the
last number of a free-form answer.

GSM8K, GPQA and the last-number grader score 1 for correct and ``wrong_score`` (0 by default, verl's convention for
these sets) otherwise; Geometry3K adds verl's 0.1 format reward. Every extraction is linear in the response length.
"""
from __future__ import annotations

import re
from decimal import Decimal

from megatron_cpo.rewards.math_answer import last_boxed, strip_string
from megatron_cpo.rewards.math_grader import numbers_close, numeric_value

_GSM8K_MARKER = re.compile(r"####\s*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_CHOICE_PATTERNS = (
    re.compile(r"\\boxed\{\s*\(?([A-J])\)?\s*\}"),
    # Whitespace runs are never adjacent to another optional whitespace run, so a failed match costs linear time
    # (three adjacent ``\s*`` backtracked cubically on "answer" followed by thousands of spaces).
    re.compile(r"(?:final answer|correct answer|answer|correct option|choice)\s*(?:(?:is|:)\s*)?(?:[:\-]\s*)?"
               r"(?:option\s*)?[\(\[\*]{0,3}([A-J])[\)\]\*]*(?![A-Za-z])", re.IGNORECASE),
    re.compile(r"\(([A-J])\)[ \t]*(?:is correct|is the (?:correct|right) answer)", re.IGNORECASE),
    re.compile(r"^[ \t]*\(?([A-J])\)?[.:)]?[ \t]*$", re.MULTILINE),
)


def _result(correct: bool, prediction: str | None, reason: str, wrong_score: float) -> dict:
    result = {"score": 1.0 if correct else float(wrong_score), "acc": correct, "pred": prediction}
    if not correct:
        result["reason"] = reason
    return result


def _to_number(text: str) -> Decimal | None:
    """The exact value of a GSM8K number ("1,234", "-3.50", "12."), else None."""
    return numeric_value(text.replace(",", "").rstrip("."))


def extract_gsm8k_answer(solution_str: str) -> str | None:
    """The number after the last ``####``, else the last ``\\boxed{}``, else None (no guessing from prose)."""
    markers = _GSM8K_MARKER.findall(solution_str)
    if markers:
        return markers[-1].replace(",", "")
    boxed = last_boxed(solution_str)
    if boxed is None:
        return None
    numbers = _NUMBER.findall(strip_string(boxed))
    return numbers[-1].replace(",", "") if numbers else None


def compute_gsm8k_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = 0.0,
) -> dict:
    """openai/gsm8k: 1 when the ``#### answer`` number equals the ground truth, else ``wrong_score`` (verl: 1/0).

    More lenient than verl's strict GSM8K check, deliberately: a ``\\boxed{}`` number counts when there is no
    ``####`` line, numbers compare by value (``12.0`` == ``12``, ``#### 12.`` reads 12) and the whole response is
    searched (verl: the last 300 characters, exact string match after removing commas).
    """
    prediction = extract_gsm8k_answer(solution_str)
    if prediction is None:
        return _result(False, None, "no '#### answer' or \\boxed{} number found", wrong_score)
    predicted, truth = _to_number(prediction), _to_number(str(ground_truth).split("####")[-1].strip())
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number; pass the final number only")
    correct = predicted is not None and numbers_close(predicted, truth, rel_tol=0.0, abs_tol=1e-6)
    return _result(correct, prediction, f"{prediction} != {ground_truth}", wrong_score)


def last_number(solution_str: str) -> str | None:
    """The last number written in the response ("1,234" -> "1234"; a sentence's final period is not a decimal
    point), else None."""
    numbers = _NUMBER.findall(solution_str)
    return numbers[-1].replace(",", "") if numbers else None


def compute_last_number_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = 0.0,
) -> dict:
    """1 when the last number of the response equals the ground truth by value, else ``wrong_score``.

    For models that answer in their own words and put no marker on the answer (SmolLM2-135M-Instruct ends with
    "... 47 + 38 = 85."): the last number is the one a reader takes as the answer, as lm-evaluation-harness's
    "flexible-extract" does for GSM8K. A response that states the right sum and then keeps writing other numbers
    scores 0: the answer must come last.
    """
    truth = _to_number(str(ground_truth).strip())
    if truth is None:
        raise ValueError(f"last-number ground truth {ground_truth!r} is not a number; pass the number only")
    prediction = last_number(solution_str)
    if prediction is None:
        return _result(False, None, "no number in the response", wrong_score)
    predicted = _to_number(prediction)
    correct = predicted is not None and numbers_close(predicted, truth, rel_tol=0.0, abs_tol=1e-6)
    return _result(correct, prediction, f"last number {prediction} != {ground_truth}", wrong_score)


def extract_choice(solution_str: str) -> str | None:
    """The option letter a response commits to ("Answer: (B)", "\\boxed{C}", "the correct answer is D", ...)."""
    for pattern in _CHOICE_PATTERNS:
        matches = pattern.findall(solution_str)
        if matches:
            return matches[-1].upper()
    return None


def compute_multiple_choice_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = 0.0,
) -> dict:
    """gpqa: the chosen letter equals the ground-truth letter."""
    truth = str(ground_truth).strip().strip("()").upper()
    if not re.fullmatch(r"[A-J]", truth):
        raise ValueError(f"multiple-choice ground truth {ground_truth!r} is not a single letter A-J")
    prediction = extract_choice(solution_str)
    if prediction is None:
        return _result(False, None, "no option letter found in the response", wrong_score)
    return _result(prediction == truth, prediction, f"chose {prediction}, answer is {truth}", wrong_score)


def has_geometry_format(solution_str: str) -> bool:
    """``<think>...</think> ... \\boxed{...} ...`` with the response starting at ``<think>`` (verl's geo3k format
    reward, the regex ``<think>.*</think>.*\\boxed\\{.*\\}.*`` fully matched), decided with three ``find`` calls."""
    if not solution_str.startswith("<think>"):
        return False
    think_end = solution_str.find("</think>", len("<think>"))
    box = solution_str.find("\\boxed{", think_end + len("</think>")) if think_end >= 0 else -1
    return box >= 0 and solution_str.find("}", box + len("\\boxed{")) >= 0


def compute_geometry_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = 0.0, rel_tol: float = 1e-2, format_score: float = 0.1,
) -> dict:
    """hiyouga/geometry3k: ``(1 - format_score) * correct + format_score * has_geometry_format`` (verl's geo3k: 1.0,
    0.9, 0.1 or 0.0); ``acc`` is the correctness alone. Correct: the boxed value is within ``rel_tol`` of the ground
    truth (more lenient than verl's exact/symbolic match: 1% slack for rounded lengths and angles), else the
    normalised strings match. ``wrong_score`` replaces the 0 of a wrong, unformatted answer."""
    formatted = has_geometry_format(solution_str)
    boxed = last_boxed(solution_str)
    if boxed is None:
        correct, reason = False, "no \\boxed{} answer found"
    else:
        predicted_text, true_text = strip_string(boxed), strip_string(str(ground_truth))
        predicted, truth = numeric_value(predicted_text), numeric_value(true_text)
        if predicted is not None and truth is not None:
            correct = numbers_close(predicted, truth, rel_tol=rel_tol, abs_tol=1e-6)
            reason = f"{predicted} not within {rel_tol:g} of {truth}"
        else:
            correct, reason = predicted_text == true_text, f"{predicted_text!r} != {true_text!r}"
    score = (1.0 - format_score) * correct + format_score * formatted
    result = _result(correct, boxed, reason, wrong_score)
    result["score"] = score if (correct or formatted) else float(wrong_score)
    result["format"] = formatted
    return result
