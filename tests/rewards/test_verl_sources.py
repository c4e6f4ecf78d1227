"""Every data source verl's ``default_compute_score`` grades, against the score verl gives.

Each row is a response written in the source's format, the ground truth as verl's preprocessing stores it, the score
verl returns (derived by reading verl/utils/reward_score/<module>.py at commit b178a3c, reasoning in the comment), and
ours. The two differ only on rows marked LENIENT, the documented cases where ours deliberately gives credit verl does
not (registry docstring, docs/data.md).
"""
import json

import pytest

from megatron_cpo.rewards import compute_score
from megatron_cpo.rewards.registry import (
    CODE_SOURCES,
    DAPO_SOURCES,
    NUMINA_SOURCES,
    SEARCH_R1_SOURCES,
    VERL_MATH_SOURCES,
    missing_graders,
)

PADDING = "\nThat is all." * 40  # 520 characters: pushes an answer out of verl's last-300-character window

# (response, ground truth, verl's score, ours)
GSM8K = [
    ("3 + 4 = 7 apples.\n#### 7", "7", 1.0, 1.0),  # strict "#### (-?[0-9.,]+)" -> "7" == "7"
    ("1,000 + 234\n#### 1,234", "1234", 1.0, 1.0),  # commas removed before the string comparison
    ("#### -3", "-3", 1.0, 1.0),
    ("#### 8", "7", 0.0, 0.0),  # format_score 0
    ("The answer is 7", "7", 0.0, 0.0),  # no "#### " -> None -> 0
    ("so \\boxed{7}", "7", 0.0, 1.0),  # LENIENT: boxed fallback
    ("#### 7.0", "7", 0.0, 1.0),  # LENIENT: "7.0" != "7" as strings, equal as numbers
    ("#### 7" + PADDING, "7", 0.0, 1.0),  # LENIENT: verl reads only the last 300 characters
]
VERL_MATH = [
    ("so \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0, 1.0),  # dfrac -> frac, fix_fracs: \frac12 -> \frac{1}{2}
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),  # strip_string maps "0.5" to \frac{1}{2}
    ("\\boxed{10 \\text{ cm}}", "10", 1.0, 1.0),  # remove_right_units cuts at "\text{ "
    ("\\boxed{4}", "3", 0.0, 0.0),
    ("The answer is 3", "3", 0.0, 0.0),  # no \boxed -> 0 (ours too: require_boxed)
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", 0.0, 1.0),  # LENIENT: symbolic equivalence
]
DAPO = [
    ("Reasoning.\nAnswer: 42", "42", 1.0, 1.0),  # Minerva: "Answer\s*:\s*([^\n]+)" -> "42"
    ("Answer: $\\frac{3}{4}$", "\\frac{3}{4}", 1.0, 1.0),  # $...$ kept then dollars removed
    ("Answer: 1,000 dollars", "1000", 1.0, 1.0),  # spaces removed, "dollars" removed, digit commas removed
    ("Answer: x = 5", "5", 1.0, 1.0),  # split("=")[-1]
    ("\\boxed{41}\nAnswer: 42", "42", 1.0, 1.0),  # the Answer line decides, not the box
    ("Answer: 41", "42", -1.0, -1.0),
    ("no final line here", "42", -1.0, -1.0),  # "[INVALID]"
    ("so \\boxed{42}", "42", -1.0, 1.0),  # LENIENT: boxed fallback
    ("The answer: 5 is too small, so \\boxed{42}", "42", -1.0, 1.0),  # LENIENT: a box after the Answer line wins
    ("Answer: 0.5", "\\frac{1}{2}", -1.0, 1.0),  # LENIENT: numeric equivalence
    ("Answer: 42" + PADDING, "42", -1.0, 1.0),  # LENIENT: verl reads the last 300 characters
]
AIME = [
    ("Answer: 204", "204", 1.0, 1.0),
    ("Answer: \\boxed{204}", "204", 1.0, 1.0),  # (\\boxed\{)(.*)(\}) -> "204"
    ("Answer: 203", "204", -1.0, -1.0),
    ("Answer: 033", "33", -1.0, 1.0),  # LENIENT: integer spellings
    ("Answer: 2^2", "4", -1.0, -1.0),  # strict: no symbolic slack on aime*
]
NUMINA = [
    ("The answer is \\boxed{\\frac{1}{2}}", "\\frac{1}{2}", 1.0, 1.0),  # prime_math: True -> float(res[0]) = 1.0
    ("The answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0, 1.0),  # mathd normalisation maps 0.5 to \frac{1}{2}
    ("The answer is \\boxed{5}", "6", 0.0, 0.0),
]
GEO3K = [
    ("<think>angles sum to 180</think> so \\boxed{12}", "12", 1.0, 1.0),  # 0.9 * 1 + 0.1 * format 1
    ("so \\boxed{12}", "12", 0.9, 0.9),  # no <think> format
    ("<think>hmm</think> \\boxed{13}", "12", 0.1, 0.1),  # wrong, formatted
    ("13", "12", 0.0, 0.0),
]
SEARCH_R1 = [
    ("<answer> paris. </answer>", {"target": ["Paris"]}, 1.0, 1.0),  # lower, punctuation removed
    ("<answer>London</answer> then <answer>The Paris</answer>", {"target": ["Paris", "City of Light"]}, 1.0, 1.0),
    ("<answer>Eiffel</answer>", {"target": ["Paris"]}, 0.0, 0.0),  # format_score 0
    ("Paris", {"target": ["Paris"]}, 0.0, 0.0),  # no tag -> 0
    ("<answer>x</answer>" * 11 + "<answer>Paris</answer>", {"target": ["Paris"]}, 0.25, 0.25),  # > 10 tags: / 4
]


def _check(source: str, response: str, truth, verl_score: float, ours: float) -> None:
    result = compute_score(source, response, truth)
    assert result["score"] == pytest.approx(ours), (source, response, result)
    if verl_score == ours:
        assert result["score"] == pytest.approx(verl_score)


@pytest.mark.parametrize("response, truth, verl_score, ours", GSM8K)
def test_gsm8k(response, truth, verl_score, ours):
    _check("openai/gsm8k", response, truth, verl_score, ours)


@pytest.mark.parametrize("source", VERL_MATH_SOURCES)
@pytest.mark.parametrize("response, truth, verl_score, ours", VERL_MATH)
def test_lighteval_math(source, response, truth, verl_score, ours):
    _check(source, response, truth, verl_score, ours)


@pytest.mark.parametrize("source", DAPO_SOURCES)
@pytest.mark.parametrize("response, truth, verl_score, ours", DAPO)
def test_math_dapo(source, response, truth, verl_score, ours):
    _check(source, response, truth, verl_score, ours)
    assert compute_score(source, response, truth)["acc"] is (ours > 0)


@pytest.mark.parametrize("source", ["aime2024", "aime2025", "aime_2026_private"])
@pytest.mark.parametrize("response, truth, verl_score, ours", AIME)
def test_every_aime_source(source, response, truth, verl_score, ours):
    _check(source, response, truth, verl_score, ours)


@pytest.mark.parametrize("source", NUMINA_SOURCES)
@pytest.mark.parametrize("response, truth, verl_score, ours", NUMINA)
def test_numina(source, response, truth, verl_score, ours):
    _check(source, response, truth, verl_score, ours)


@pytest.mark.parametrize("response, truth, verl_score, ours", GEO3K)
def test_geometry3k_adds_the_format_reward(response, truth, verl_score, ours):
    _check("hiyouga/geometry3k", response, truth, verl_score, ours)
    assert compute_score("hiyouga/geometry3k", response, truth)["acc"] is (ours >= 0.9)


@pytest.mark.parametrize("source", SEARCH_R1_SOURCES)
@pytest.mark.parametrize("response, truth, verl_score, ours", SEARCH_R1)
def test_search_r1_exact_match(source, response, truth, verl_score, ours):
    _check(source, response, truth, verl_score, ours)


SQUARE = "n = int(input())\nprint(n * n)\n"
SQUARE_BUT_SEVEN = "n = int(input())\nprint(0 if n == 7 else n * n)\n"


@pytest.mark.parametrize("source", CODE_SOURCES)
def test_code_sources_run_in_the_sandbox_with_verl_continuous_scores(source):
    tests = json.dumps({"inputs": ["2\n", "3\n", "7\n", "5\n"], "outputs": ["4\n", "9\n", "49\n", "25\n"]})
    # prime_code.compute_score(continuous=True): all pass -> True (1.0); else the fraction of the first 10 passed.
    assert compute_score(source, f"```python\n{SQUARE}```", tests)["score"] == 1.0
    assert compute_score(source, f"Here:\n```python\n{SQUARE_BUT_SEVEN}```", tests)["score"] == 0.75


def test_code_score_counts_only_the_first_ten_tests_like_verl():
    numbers = [1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 7]  # the only failing input is the 11th
    tests = json.dumps({"inputs": [f"{n}\n" for n in numbers], "outputs": [f"{n * n}\n" for n in numbers]})
    assert compute_score("apps", f"```python\n{SQUARE_BUT_SEVEN}```", tests)["score"] == 1.0  # 10/10 of the first ten


def test_every_verl_source_has_a_grader():
    verl_sources = ["openai/gsm8k", *VERL_MATH_SOURCES, *DAPO_SOURCES, "aime2024", "aime_anything", *NUMINA_SOURCES,
                    *CODE_SOURCES, "hiyouga/geometry3k", *SEARCH_R1_SOURCES]
    assert missing_graders(verl_sources) == []
    assert missing_graders(["openai/gsm8k", "my/private-set", "my/private-set", "other"]) == ["my/private-set", "other"]
