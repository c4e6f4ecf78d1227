"""Code grader (codecontests, apps, codeforces, taco): run the candidate against test cases in the sandbox.

Ground truth is APPS/TACO's ``{inputs, outputs[, fn_name]}``: stdin/stdout programs, or calls of ``fn_name``. Each
case is a separate sandboxed process; ``continuous`` scores the fraction passed, else all-or-nothing (docs/data.md).
"""
from __future__ import annotations

import json
import math
import re
import time
from concurrent.futures import ThreadPoolExecutor

from megatron_cpo.rewards.sandbox import active_mode, current_settings, run_python
from megatron_cpo.rewards.sandbox_types import SandboxLimits

_CODE_BLOCK = re.compile(r"```(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(solution_str: str) -> str:
    """The last fenced code block of a response, or the whole response when it has none."""
    blocks = _CODE_BLOCK.findall(solution_str)
    return blocks[-1] if blocks else solution_str


def _tokens_equal(produced: str, expected: str) -> bool:
    if produced == expected:
        return True
    try:
        return math.isclose(float(produced), float(expected), rel_tol=1e-6, abs_tol=1e-6)
    except ValueError:
        return False


def stdout_matches(produced: str, expected: str) -> bool:
    """Line-by-line, token-by-token comparison; trailing whitespace and blank trailing lines are ignored."""
    produced_lines = [line.split() for line in produced.strip().splitlines()]
    expected_lines = [line.split() for line in expected.strip().splitlines()]
    if len(produced_lines) != len(expected_lines):
        return " ".join(produced.split()) == " ".join(expected.split())
    return all(len(p) == len(e) and all(_tokens_equal(a, b) for a, b in zip(p, e))
               for p, e in zip(produced_lines, expected_lines))


def _canonical(value: object) -> object:
    return json.loads(json.dumps(value, default=list))


def return_value_matches(produced_json: str, expected: object) -> bool:
    """The JSON result of a call equals the expected value, or its APPS one-element-list wrapping."""
    try:
        produced = json.loads(produced_json)
    except json.JSONDecodeError:
        return False
    expected = _canonical(expected)
    return produced == expected or [produced] == expected


def parse_test_cases(ground_truth: str | dict) -> tuple[list, list, str | None]:
    """(inputs, outputs, fn_name) from APPS/TACO ground truth; raises ValueError naming what is malformed."""
    spec = json.loads(ground_truth) if isinstance(ground_truth, str) else ground_truth
    if not isinstance(spec, dict) or not isinstance(spec.get("inputs"), list) or not isinstance(
            spec.get("outputs"), list):
        raise ValueError(f"code ground truth must be JSON with 'inputs' and 'outputs' lists, got {str(spec)[:200]!r}")
    if len(spec["inputs"]) != len(spec["outputs"]) or not spec["inputs"]:
        raise ValueError(f"code ground truth has {len(spec['inputs'])} inputs and {len(spec['outputs'])} outputs; "
                         "they must be equal and non-zero")
    return spec["inputs"], spec["outputs"], spec.get("fn_name")


def _as_text(value: object) -> str:
    return "\n".join(map(str, value)) if isinstance(value, list) else str(value)


def compute_code_score(
    data_source: str, solution_str: str, ground_truth: str | dict, extra_info: dict | None = None, *,
    continuous: bool = True, wrong_score: float = -1.0, limits: SandboxLimits | dict | None = None,
    max_tests: int = 32, total_timeout_s: float = 20.0,
) -> dict:
    """Run the candidate on up to ``max_tests`` cases (and at most ``total_timeout_s``) in the sandbox.

    ``limits`` may be a dict of ``SandboxLimits`` fields, as it arrives from a YAML ``grader_kwargs`` entry.
    """
    inputs, outputs, fn_name = parse_test_cases(ground_truth)
    program = extract_code(solution_str)
    limits = SandboxLimits(**limits) if isinstance(limits, dict) else (limits or SandboxLimits())
    cases = list(zip(inputs, outputs))[:max_tests]

    def run_case(case: tuple) -> str:
        test_input, expected = case
        if fn_name:
            run = run_python(program, json.dumps(test_input), limits=limits, mode="call", fn_name=fn_name)
            passed = run.status == "ok" and return_value_matches(run.stdout, expected)
        else:
            run = run_python(program, _as_text(test_input), limits=limits)
            passed = run.status == "ok" and stdout_matches(run.stdout, _as_text(expected))
        return "passed" if passed else (run.status if run.status != "ok" else "wrong_answer")

    statuses: list[str] = []
    if active_mode() == "remote":  # latency-bound: cases of one sample in parallel, as verl does
        with ThreadPoolExecutor(min(current_settings().fusion_max_concurrent, len(cases))) as executor:
            for status in executor.map(run_case, cases):
                statuses.append(status)
                if status != "passed" and not continuous:
                    break
    else:
        deadline = time.monotonic() + total_timeout_s
        for case in cases:
            if time.monotonic() > deadline:
                statuses.append("budget_exhausted")
                break
            statuses.append(run_case(case))
            if statuses[-1] != "passed" and not continuous:
                break
    total = min(len(inputs), max_tests)
    passed_count = statuses.count("passed")
    all_passed = passed_count == total
    score = passed_count / total if continuous else (1.0 if all_passed else float(wrong_score))
    result = {"score": score, "acc": all_passed, "pred": f"{passed_count}/{total} tests passed",
              "test_statuses": statuses}
    if not all_passed:
        first_failure = next(index for index, status in enumerate(statuses) if status != "passed")
        result["reason"] = f"test {first_failure}: {statuses[first_failure]}"
    return result
