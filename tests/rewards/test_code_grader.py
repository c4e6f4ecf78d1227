"""Code grader: APPS/TACO stdin/stdout and call-based tests run in the sandbox, continuous and all-or-nothing."""
import json

import pytest

from megatron_cpo.rewards import compute_score
from megatron_cpo.rewards.code_grader import compute_code_score, extract_code, stdout_matches
from megatron_cpo.rewards.sandbox_types import SandboxLimits

FAST = SandboxLimits(wall_timeout_s=5.0, cpu_time_s=1, memory_mb=256)
STDIO_TESTS = json.dumps({"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30\n", "0\n"]})
ADD = "Here is my solution:\n```python\na, b = map(int, input().split())\nprint(a + b)\n```\nDone."


def test_correct_stdio_program_passes_every_test():
    result = compute_score("codecontests", ADD, STDIO_TESTS, limits=FAST)
    assert (result["score"], result["acc"], result["pred"]) == (1.0, True, "3/3 tests passed")


def test_partially_correct_program_scores_the_fraction_passed():
    wrong_on_negative = "```python\na, b = map(int, input().split())\nprint(abs(a) + abs(b))\n```"
    result = compute_score("apps", wrong_on_negative, STDIO_TESTS, limits=FAST)
    assert result["score"] == pytest.approx(2 / 3) and not result["acc"]
    assert result["reason"] == "test 2: wrong_answer"


def test_all_or_nothing_stops_at_first_failure():
    wrong_first = "```python\nprint(0)\n```"
    result = compute_code_score("taco", wrong_first, STDIO_TESTS, continuous=False, limits=FAST)
    assert result["score"] == -1.0 and result["test_statuses"] == ["wrong_answer"]


def test_call_based_tests_accept_apps_wrapped_outputs():
    truth = {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[[0, 1]], [1, 2]]}
    solution = ("```python\nclass Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n"
                "        for i, n in enumerate(nums):\n            if target - n in seen:\n"
                "                return [seen[target - n], i]\n            seen[n] = i\n```")
    assert compute_score("codeforces", solution, truth, limits=FAST)["acc"]


def test_hostile_candidate_fails_its_tests_without_harming_the_grader():
    loop = "```python\nwhile True:\n    pass\n```"
    result = compute_code_score("apps", loop, json.dumps({"inputs": ["1\n"], "outputs": ["1\n"]}), limits=FAST)
    assert result["score"] == 0.0 and result["test_statuses"][0] in ("cpu_limit", "timeout")


def test_total_budget_bounds_grading_time():
    sleeper = "```python\nimport time\ntime.sleep(5)\n```"
    tests = json.dumps({"inputs": ["\n"] * 5, "outputs": ["\n"] * 5})
    limits = SandboxLimits(wall_timeout_s=0.5, cpu_time_s=1)
    result = compute_code_score("apps", sleeper, tests, limits=limits, total_timeout_s=0.8)
    assert result["test_statuses"][-1] == "budget_exhausted" and len(result["test_statuses"]) < 5


def test_output_comparison_is_whitespace_and_float_tolerant():
    assert stdout_matches("1 2  \n3\n\n", "1 2\n3")
    assert stdout_matches("0.3333333", "0.33333333")
    assert not stdout_matches("1 2", "1 3")
    assert extract_code("no fences: print(1)") == "no fences: print(1)"


@pytest.mark.parametrize("truth", ['{"inputs": [1]}', '{"inputs": [], "outputs": []}', "[1, 2]"])
def test_malformed_ground_truth_is_a_clear_error(truth):
    with pytest.raises(ValueError, match="inputs"):
        compute_score("apps", ADD, truth)
