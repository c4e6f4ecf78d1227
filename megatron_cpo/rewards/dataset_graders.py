"""Graders for the verl data sources that need their own answer format: DAPO-Math ("Answer: ..." lines, scored +1/-1)
and Search-R1 question answering (``<answer>...</answer>`` exact match, scored 1/0).

Both follow verl's ``default_compute_score`` semantics (``verl/utils/reward_score/math_dapo.py`` and
``search_r1_like_qa_em.py``), reimplemented here with every step linear in the response length. Where ours is
deliberately more lenient than verl it says so in the function's docstring; ``docs/data.md`` has the full table.
"""
from __future__ import annotations

import re
import string
from typing import Any

from megatron_cpo.rewards.math_answer import last_boxed_at
from megatron_cpo.rewards.math_grader import INTEGER, integers_equal, math_equivalent

_ANSWER_LINE = re.compile(r"Answer\s*:\s*([^\n]+)", re.IGNORECASE)
MAX_ANSWER_CHARS = 300  # verl reads only the last 300 characters of a response; a longer "answer" is not one

# Minerva normalisation (Lewkowycz et al. 2022, as verl's math_dapo applies it): literal rewrites, then removals.
_MINERVA_REWRITES = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                     (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_MINERVA_REMOVALS = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3",
    "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)
_MINERVA_PATTERNS = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), "$\\3$"),
    (re.compile(r"(\\text\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), "\\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), "\\2"),
    (re.compile(r"(frac)([^{])(.)"), "frac{\\2}{\\3}"),
    (re.compile(r"(sqrt)([^{])"), "sqrt{\\2}"),
)


def minerva_normalise(answer: str) -> str:
    """The Minerva normal form of a final answer (what DAPO compares as strings). The lazy ``$...$`` pattern only
    runs when two dollars are present (on a long dollar-free text it would be quadratic); predictions reach here
    capped at ``MAX_ANSWER_CHARS``."""
    text = str(answer).split("=")[-1]
    for before, after in _MINERVA_REWRITES:
        text = text.replace(before, after)
    for removed in _MINERVA_REMOVALS:
        text = text.replace(removed, "")
    for index, (pattern, replacement) in enumerate(_MINERVA_PATTERNS):
        if index > 0 or text.count("$") >= 2:
            text = pattern.sub(replacement, text)
    text = text.replace("$", "")
    if text.replace(",", "").isdigit():
        text = text.replace(",", "")
    return text.strip()


def dapo_answer(solution_str: str) -> tuple[str | None, str]:
    """(the answer a DAPO-style response gives, where it came from): the last "Answer: ..." line, unless a
    ``\\boxed{}`` comes after its "Answer:" (a response to a boxed-style prompt that said "answer:" mid-reasoning; for
    "Answer: \\boxed{x}" both read x), else the last ``\\boxed{}`` (a lenient fallback verl does not have), else
    (None, "none")."""
    matches = list(_ANSWER_LINE.finditer(solution_str))
    last = matches[-1] if matches else None
    boxed = last_boxed_at(solution_str)
    if last is not None and (boxed is None or boxed[1] < last.start()):
        return last.group(1)[:MAX_ANSWER_CHARS], "answer_line"
    return (boxed[0], "boxed") if boxed is not None else (None, "none")


def compute_dapo_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None, *,
    wrong_score: float = -1.0, strict: bool = False, symbolic_timeout_s: float = 5.0,
) -> dict:
    """math_dapo, math, math_dapo_reasoning and aime*: +1 when the "Answer:" line equals the ground truth, else -1.

    Minerva normal forms as in verl, with the leniencies docs/data.md lists; ``strict`` (aime*) allows only integer
    spellings to differ (``042`` for ``42``).
    """
    raw, origin = dapo_answer(solution_str)
    if raw is None:
        return {"score": float(wrong_score), "acc": False, "pred": None, "reason": "no 'Answer:' line or \\boxed{}"}
    predicted, truth = minerva_normalise(raw), minerva_normalise(str(ground_truth))
    if predicted == truth:
        correct, how = True, "minerva"
    elif strict:
        correct = bool(INTEGER.match(predicted) and INTEGER.match(truth) and integers_equal(predicted, truth))
        how = "integer" if correct else f"strict mismatch: {predicted!r} vs {truth!r}"
    else:
        correct, how = math_equivalent(predicted, truth, symbolic_timeout_s)
    result = {"score": 1.0 if correct else float(wrong_score), "acc": correct, "pred": predicted, "source": origin}
    result["method" if correct else "reason"] = how
    return result


def normalise_qa_answer(text: str) -> str:
    """SQuAD-style answer normal form: lower case, no punctuation, no articles, single spaces."""
    text = str(text).lower()
    text = "".join(char for char in text if char not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")


def tagged_answer(solution_str: str, open_tag: str = "<answer>", close_tag: str = "</answer>") -> str | None:
    """The last ``<answer>...</answer>`` span, pairing each opening tag with the next closing one (as a lazy regex
    would), found in one left-to-right pass; None when there is no closed span."""
    position, found = 0, None
    while True:
        start = solution_str.find(open_tag, position)
        if start < 0:
            return found
        end = solution_str.find(close_tag, start + len(open_tag))
        if end < 0:
            return found
        found = solution_str[start + len(open_tag):end].strip()
        position = end + len(close_tag)


def _targets(ground_truth: Any) -> list[str]:
    if isinstance(ground_truth, dict):
        ground_truth = ground_truth.get("target")
    if isinstance(ground_truth, str):
        return [ground_truth]
    if isinstance(ground_truth, (list, tuple)) and ground_truth:
        return [str(target) for target in ground_truth]
    raise ValueError(f"Search-R1 ground truth must be {{'target': [answers]}}, a list or a string; got "
                     f"{str(ground_truth)[:200]!r}")


def compute_qa_exact_match_score(
    data_source: str, solution_str: str, ground_truth: Any, extra_info: dict | None = None, *,
    score: float = 1.0, format_score: float = 0.0, max_tags: int = 10,
) -> dict:
    """searchR1_*: ``score`` when the last ``<answer>`` equals one target after normalisation, ``score / 4`` when it
    does but the response has more than ``max_tags`` opening or closing tags, ``format_score`` for a wrong answer and
    0 without one (verl's ``search_r1_like_qa_em.compute_score``, same values)."""
    targets = _targets(ground_truth)
    answer = tagged_answer(solution_str)
    if answer is None:
        return {"score": 0.0, "acc": False, "pred": None, "reason": "no <answer>...</answer> span"}
    normalised = normalise_qa_answer(answer)
    if not any(normalise_qa_answer(target) == normalised for target in targets):
        return {"score": float(format_score), "acc": False, "pred": answer,
                "reason": f"{normalised!r} matches none of {targets[:5]!r}"}
    too_many_tags = solution_str.count("<answer>") > max_tags or solution_str.count("</answer>") > max_tags
    return {"score": score / 4 if too_many_tags else float(score), "acc": True, "pred": answer}
