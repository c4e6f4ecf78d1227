"""GSM8K, GPQA multiple choice and Geometry3K graders, reached through the registry."""
import pytest

from megatron_cpo.rewards import compute_score


@pytest.mark.parametrize("solution, truth, correct", [
    ("3 + 4 = 7 apples.\n#### 7", "7", True),
    ("Total is 1,234 dollars\n#### 1,234", "1234", True),
    ("so \\boxed{1,000}", "1000", True),
    ("#### 12.0", "12", True),
    ("#### 8", "7", False),
    ("The answer is 7", "7", False),
    ("first #### 5 then corrected #### 6", "6", True),
    ("#### -3", "-3", True),
])
def test_gsm8k(solution, truth, correct):
    result = compute_score("openai/gsm8k", solution, truth)
    assert result["acc"] is correct
    assert result["score"] == (1.0 if correct else 0.0)


def test_gsm8k_rejects_non_numeric_ground_truth():
    with pytest.raises(ValueError, match="not a number"):
        compute_score("openai/gsm8k", "#### 3", "three")


@pytest.mark.parametrize("solution, truth, correct", [
    ("Let me think... The correct answer is (B).", "B", True),
    ("Answer: C", "C", True),
    ("After elimination, \\boxed{D}", "D", True),
    ("The answer is A, since B is impossible.", "A", True),
    ("(C) is correct", "C", True),
    ("Final answer: **B**", "b", True),
    ("Answer: A", "B", False),
    ("I am not sure.", "A", False),
])
def test_gpqa_multiple_choice(solution, truth, correct):
    result = compute_score("gpqa", solution, truth)
    assert result["acc"] is correct
    assert result["score"] == (1.0 if correct else 0.0)
    if not correct:
        assert result["reason"]


def test_gpqa_rejects_a_non_letter_ground_truth():
    with pytest.raises(ValueError, match="single letter"):
        compute_score("gpqa", "Answer: A", "42")


@pytest.mark.parametrize("solution, truth, correct", [
    ("\\boxed{12.5}", "12.5", True), ("\\boxed{12.49}", "12.5", True), ("\\boxed{13}", "12.5", False),
    ("\\boxed{2\\sqrt{3}}", "2\\sqrt{3}", True), ("\\boxed{\\frac{1}{3}}", "0.333", True), ("no box", "3", False),
])
def test_geometry3k_numeric_tolerance(solution, truth, correct):
    assert compute_score("hiyouga/geometry3k", solution, truth)["acc"] is correct


@pytest.mark.parametrize("solution, truth, correct", [
    ("To add 47 and 38, add the ones and the tens: 47 + 38 = 85.", "85", True),
    ("47 + 38 equals 85", "85", True),
    ("The sum is 1,085.", "1085", True),
    ("85.0", "85", True),
    ("47 + 38 = 85. So 85 - 3 = 82.", "85", False),  # the answer must come last
    ("It is 75.", "85", False),
    ("I cannot add these numbers.", "85", False),
])
def test_last_number_for_answers_in_prose(solution, truth, correct):
    result = compute_score("megatron_cpo/addition", solution, truth)
    assert result["acc"] is correct and result["score"] == (1.0 if correct else 0.0)
    assert correct or "reason" in result


def test_last_number_rejects_a_non_numeric_ground_truth():
    with pytest.raises(ValueError, match="not a number"):
        compute_score("megatron_cpo/addition", "85", "eighty-five")
