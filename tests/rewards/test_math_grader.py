"""The math grader against a labelled table, answer extraction, AIME strictness and score conventions."""
import time

import pytest

from megatron_cpo.rewards import compute_score
from megatron_cpo.rewards.math_answer import extract_answer, last_boxed, strip_string
from megatron_cpo.rewards.math_grader import compute_math_score
from tests.rewards.math_cases import CASES, GROUPS


def test_table_is_large_and_covers_every_category():
    assert len(CASES) >= 150
    assert all(len(rows) >= 5 for rows in GROUPS.values())
    assert sum(expected for *_, expected in CASES) > 40 and sum(not expected for *_, expected in CASES) > 40


@pytest.mark.parametrize("group", sorted(GROUPS))
def test_math_grader_agrees_with_labelled_table(group):
    disagreements = []
    for prediction, truth, expected in GROUPS[group]:
        result = compute_math_score("math", f"Some reasoning.\nSo the result is \\boxed{{{prediction}}}.", truth,
                                    symbolic_timeout_s=3)
        if result["acc"] is not expected:
            disagreements.append((prediction, truth, expected, result))
        assert result["score"] == (1.0 if expected else -1.0) or result["acc"] is not expected
        assert ("reason" in result) is (not result["acc"])
    assert not disagreements, f"{group}: grader disagrees with the table on {disagreements}"


def test_last_boxed_handles_nesting_fbox_and_space_form():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{a}{b^{2}}} end") == r"\frac{a}{b^{2}}"
    assert last_boxed(r"\fbox{7} and nothing else") == "7"
    assert last_boxed(r"\boxed{1} later \fbox{2}") == "2"
    assert last_boxed(r"$\boxed 42$") == "42"
    assert last_boxed(r"unclosed \boxed{3") is None
    assert last_boxed("no box at all") is None


@pytest.mark.parametrize("text, answer", [
    ("We get x = 5. The final answer is $\\frac{3}{4}$.", r"\frac{3}{4}"),
    ("Answer: 12", "12"),
    ("So the answer is 7.", "7"),
    ("Adding 3 and 4 gives 7, then doubling yields 14", "14"),
    ("", None),
    ("no numbers here", None),
    ("Answering quickly: 3 cats and 4 dogs", "4"),
])
def test_extraction_falls_back_to_announced_answer_then_last_number(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize("raw, normalised", [
    (r"\left( \dfrac12, 3 \right)", r"(\frac{1}{2},3)"), (r"45^{\circ}", "45"), (r"10\text{ cm}", "10"),
    (r".5", r"\frac{1}{2}"), (r"\sqrt3", r"\sqrt{3}"), (r"x = 4", "4"), (r"1,000", "1000"), (r"3/4", r"\frac{3}{4}"),
])
def test_strip_string_normalises_typesetting(raw, normalised):
    assert strip_string(raw) == normalised


def test_decision_stage_is_reported():
    assert compute_math_score("math", r"\boxed{\dfrac{1}{2}}", r"\frac12")["method"] == "exact"
    assert compute_math_score("math", r"\boxed{0.25}", r"\frac{1}{4}")["method"] == "numeric"
    assert compute_math_score("math", r"\boxed{(x+1)^2}", r"x^2+2x+1")["method"] == "symbolic"
    assert compute_math_score("math", "no answer", "3")["reason"] == "no answer found in the response"


def test_power_tower_never_reaches_sympy():
    started = time.process_time()
    result = compute_math_score("math", r"\boxed{10^{10^{10^{10}}}}", "5", symbolic_timeout_s=1)
    assert not result["acc"] and "symbolic check skipped" in result["reason"]
    assert time.process_time() - started < 5


def test_cpu_budget_interrupts_python_work_in_the_main_thread():
    from megatron_cpo.rewards.symbolic import SymbolicTimeout, cpu_time_budget

    started = time.process_time()
    with pytest.raises(SymbolicTimeout, match="exceeded 0.3 CPU seconds"):
        with cpu_time_budget(0.3):
            while True:
                pass
    assert time.process_time() - started < 5


def test_scores_are_plus_minus_one_by_default_and_one_zero_on_request():
    assert compute_score("math500", r"\boxed{2}", "2")["score"] == 1.0
    assert compute_score("math500", r"\boxed{3}", "2")["score"] == -1.0
    assert compute_score("math500", r"\boxed{3}", "2", wrong_score=0.0)["score"] == 0.0


@pytest.mark.parametrize("source", ["aime2024", "aime2025", "amc23"])
def test_competition_sources_use_strict_matching(source):
    assert compute_score(source, r"\boxed{033}", "33")["acc"]
    assert compute_score(source, r"\boxed{\text{ 204 }}", "204")["acc"]
    wrong = compute_score(source, r"\boxed{2^2}", "4")
    assert not wrong["acc"] and wrong["score"] == -1.0 and "strict mismatch" in wrong["reason"]
    assert compute_score("math500", r"\boxed{2^2}", "4")["acc"]


def test_arithmetic_task_source_uses_math_grader_with_plus_minus_one():
    assert compute_score("megatron_cpo/arith", "12+30 = 42, so \\boxed{42}", "42") == {
        "score": 1.0, "acc": True, "pred": "42", "method": "exact"}
    wrong = compute_score("megatron_cpo/arith", "\\boxed{41}", "42")
    assert wrong["score"] == -1.0 and wrong["pred"] == "41" and wrong["reason"]
