"""Graders for short final answers: GSM8K numbers, GPQA multiple choice letters, Geometry3K numeric values.

All three score 1 for correct and ``wrong_score`` (0 by default, verl's convention for these sets) otherwise.
"""
from __future__ import annotations

import re
from decimal import Decimal

from megatron_cpo.rewards.math_answer import last_boxed, strip_string
from megatron_cpo.rewards.math_grader import numbers_close, numeric_value

_GSM8K_MARKER = re.compile(r"####[ \t]*(-?\d[\d,]*(?:\.\d+)?|-?\.\d+)")
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
    """openai/gsm8k: the ``#### answer`` (or boxed) number equals the ground truth number (commas ignored)."""
    prediction = extract_gsm8k_answer(solution_str)
    if prediction is None:
        return _result(False, None, "no '#### answer' or \\boxed{} number found", wrong_score)
    predicted, truth = _to_number(prediction), _to_number(str(ground_truth).split("####")[-1].strip())
    if truth is None:
        raise ValueError(f"gsm8k ground truth {ground_truth!r} is not a number; pass the final number only")
    correct = predicted is not None and numbers_close(predicted, truth, rel_tol=0.0, abs_tol=1e-6)
    return _result(correct, prediction, f"{prediction} != {ground_truth}", wrong_score)


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


def compute_geometry_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = 0.0, rel_tol: float = 1e-2,
) -> dict:
    """hiyouga/geometry3k: boxed numeric answer within ``rel_tol`` of the ground truth, else normalised match."""
    boxed = last_boxed(solution_str)
    if boxed is None:
        return _result(False, None, "no \\boxed{} answer found", wrong_score)
    predicted_text, true_text = strip_string(boxed), strip_string(str(ground_truth))
    predicted, truth = numeric_value(predicted_text), numeric_value(true_text)
    if predicted is not None and truth is not None:
        correct = numbers_close(predicted, truth, rel_tol=rel_tol, abs_tol=1e-6)
        return _result(correct, boxed, f"{predicted} not within {rel_tol:g} of {truth}", wrong_score)
    return _result(predicted_text == true_text, boxed, f"{predicted_text!r} != {true_text!r}", wrong_score)
