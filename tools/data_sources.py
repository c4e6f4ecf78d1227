"""Per-dataset converters from a source record (one row of the dataset's usual release file) to the verl schema.

Each converter reads one record and returns a `Converted` (question text, ground truth, gold solution, extra fields)
or raises `RecordError` saying which field is missing or malformed. Adding a dataset touches one place: a `Source`
row in `SOURCES`. The gold solution goes to `extra_info.solution`, where CPO reads its hint.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from megatron_cpo.rewards.math_answer import last_boxed as parse_last_boxed

MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
CHOICE_INSTRUCTION = "Reason step by step, then give the letter of the correct option within \\boxed{}."
CODE_INSTRUCTION = ("Write a Python 3 program that reads from standard input and writes to standard output. "
                    "Put the whole program in one ```python code block.")
CHOICE_LETTERS = "ABCD"


class RecordError(ValueError):
    """A source record cannot be converted; the message names the field and what is wrong with it."""


@dataclass
class Converted:
    """One converted record before it is wrapped into a verl row."""

    question: str
    ground_truth: str
    solution: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _first(record: dict, *names: str, required: bool = True) -> Any:
    """The first present, non-empty field among `names` (datasets spell the same field differently)."""
    for name in names:
        value = record.get(name)
        if value is not None and (not isinstance(value, str) or value.strip()):
            return value
    if required:
        raise RecordError(f"missing field {' / '.join(repr(n) for n in names)}")
    return None


def _text(record: dict, *names: str) -> str:
    value = _first(record, *names)
    if not isinstance(value, (str, int, float)) or isinstance(value, bool):
        raise RecordError(f"field {names[0]!r} must be text, got {type(value).__name__}")
    return str(value).strip()


def last_boxed(text: str) -> str | None:
    """Stripped content of the last `\\boxed{...}` / `\\fbox{...}` in `text` (the graders' parser); None if none."""
    found = parse_last_boxed(text)
    return found.strip() if found is not None else None


def convert_gsm8k(record: dict) -> Converted:
    """openai/gsm8k: `question`, `answer` with the reasoning and a final `#### number` line."""
    question, answer = _text(record, "question"), _text(record, "answer")
    if "####" not in answer:
        raise RecordError(f"field 'answer' has no '#### <number>' final line: {answer[-60:]!r}")
    reasoning, final = answer.rsplit("####", 1)
    final = final.strip().replace(",", "")
    if not re.fullmatch(r"-?\d+(\.\d+)?", final):
        raise RecordError(f"field 'answer' ends in '#### {final}', which is not a number")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
    return Converted(question, final, f"{reasoning}\n#### {final}")


def convert_math(record: dict) -> Converted:
    """hendrycks MATH / MATH-500: `problem`, `solution` ending in \\boxed{}, optional `answer`, `level`, `type`."""
    problem, solution = _text(record, "problem", "question"), _text(record, "solution")
    answer = _first(record, "answer", required=False)
    answer = str(answer).strip() if answer is not None else last_boxed(solution)
    if not answer:
        raise RecordError("no 'answer' field and no \\boxed{...} in field 'solution'")
    extra = {key: str(record[key]) for key in ("level", "type", "subject", "unique_id") if record.get(key) is not None}
    return Converted(problem, answer, solution, extra)


def convert_aime(record: dict) -> Converted:
    """AIME (AI-MO / Maxwell-Jia releases): `problem`, integer `answer` in [0, 999], optional `solution`."""
    problem = _text(record, "problem", "Problem", "question")
    answer = _text(record, "answer", "Answer")
    if not re.fullmatch(r"\d{1,3}", answer.lstrip("0") or "0"):
        raise RecordError(f"field 'answer'={answer!r} is not an AIME answer (an integer 0..999)")
    solution = _first(record, "solution", "Solution", required=False)
    extra = {"year": str(record["year"])} if record.get("year") is not None else {}
    return Converted(problem, str(int(answer)), str(solution).strip() if solution else None, extra)


def _shuffled_choices(question: str, correct: str, wrong: list[str]) -> tuple[list[str], str]:
    """Options in an order fixed by the question text (reproducible across runs); returns (options, gold letter)."""
    options = [correct] + wrong
    keys = [hashlib.sha256(f"{question}\x00{option}".encode()).hexdigest() for option in options]
    order = sorted(range(len(options)), key=keys.__getitem__)
    return [options[i] for i in order], CHOICE_LETTERS[order.index(0)]


def convert_gpqa(record: dict) -> Converted:
    """GPQA (Idavidrein/gpqa csv/parquet): `Question`, `Correct Answer`, `Incorrect Answer 1..3`, `Explanation`."""
    question = _text(record, "Question", "question")
    correct = _text(record, "Correct Answer", "correct_answer")
    wrong = [_text(record, f"Incorrect Answer {i}", f"incorrect_answer_{i}") for i in (1, 2, 3)]
    options, letter = _shuffled_choices(question, correct, wrong)
    body = question + "\n\n" + "\n".join(f"({CHOICE_LETTERS[i]}) {option}" for i, option in enumerate(options))
    explanation = _first(record, "Explanation", "explanation", required=False)
    solution = f"{explanation}\n\nThe answer is \\boxed{{{letter}}}." if explanation else None
    return Converted(body, letter, solution, {"options": json.dumps(options)})


def _test_lists(tests: Any, name: str) -> tuple[list, list]:
    if isinstance(tests, str):
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as error:
            raise RecordError(f"field {name!r} is not valid JSON ({error.msg} at char {error.pos})") from error
    if not isinstance(tests, dict):
        raise RecordError(f"field {name!r} must hold 'input'/'output' lists, got {type(tests).__name__}")
    inputs = tests.get("input", tests.get("inputs")) or []
    outputs = tests.get("output", tests.get("outputs")) or []
    if len(inputs) != len(outputs):
        raise RecordError(f"field {name!r} has {len(inputs)} inputs but {len(outputs)} outputs")
    return list(inputs), list(outputs)


def _python_solution(solutions: Any) -> str | None:
    """A Python reference solution from code_contests' {language, solution} lists or an APPS/TACO JSON list."""
    if isinstance(solutions, str):
        try:
            solutions = json.loads(solutions)
        except json.JSONDecodeError:
            return solutions
    if isinstance(solutions, dict):
        python = [s for lang, s in zip(solutions.get("language", []), solutions.get("solution", [])) if lang in (1, 3)]
        return python[0] if python else None
    if isinstance(solutions, list) and solutions:
        return str(solutions[0])
    return None


def convert_code(record: dict) -> Converted:
    """deepmind/code_contests (`description`, `public_tests`/`private_tests`/`generated_tests`) or APPS/TACO
    (`question`, `input_output` JSON with `inputs`/`outputs`/`fn_name`); tests become the JSON ground truth."""
    statement = _text(record, "description", "question", "problem")
    inputs, outputs, fn_name = [], [], None
    if record.get("input_output") is not None:
        inputs, outputs = _test_lists(record["input_output"], "input_output")
        raw = record["input_output"]
        fn_name = (json.loads(raw) if isinstance(raw, str) else raw).get("fn_name")
    for name in ("public_tests", "private_tests", "generated_tests"):
        if record.get(name) is not None:
            more_in, more_out = _test_lists(record[name], name)
            inputs, outputs = inputs + more_in, outputs + more_out
    if not inputs:
        raise RecordError("no test cases: give 'public_tests'/'private_tests' or 'input_output' with inputs")
    truth = {"inputs": inputs, "outputs": outputs, **({"fn_name": fn_name} if fn_name else {})}
    solution = _python_solution(_first(record, "solutions", required=False))
    code = f"```python\n{solution.strip()}\n```" if solution else None
    extra = {"name": str(record["name"])} if record.get("name") is not None else {}
    return Converted(statement, json.dumps(truth), code, extra)


@dataclass(frozen=True)
class Source:
    """A dataset kind: its converter, the `data_source` its rows get (which picks the grader), ability, prompt."""

    convert: Callable[[dict], Converted]
    data_source: str
    ability: str
    instruction: str


SOURCES: dict[str, Source] = {
    "gsm8k": Source(convert_gsm8k, "openai/gsm8k", "math", GSM8K_INSTRUCTION),
    "math": Source(convert_math, "hendrycks_math", "math", MATH_INSTRUCTION),
    "aime": Source(convert_aime, "aime2024", "math", MATH_INSTRUCTION),
    "gpqa": Source(convert_gpqa, "gpqa", "science", CHOICE_INSTRUCTION),
    "code": Source(convert_code, "codecontests", "code", CODE_INSTRUCTION),
}
