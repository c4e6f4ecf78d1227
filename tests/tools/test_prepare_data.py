"""tools/prepare_data.py on small release-format fixtures (JSONL, JSON, CSV, parquet), broken rows included.

Every good row must pass the dataset reader's validator and its gold solution must be graded correct by the real
grader its `data_source` selects; every bad row must be named with what is wrong with it.
"""
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(ROOT / "tools"))

from data_sources import last_boxed  # noqa: E402
from prepare_data import main, prepare, read_records  # noqa: E402

from megatron_cpo.data.dataset import read_parquet_rows, validate_rows  # noqa: E402
from megatron_cpo.rewards import compute_score  # noqa: E402

# kind, fixture, number of good rows, expected (location, fragment of the message) of every bad row
CASES = [
    ("gsm8k", "gsm8k.jsonl", 3, [("line 3", "no '#### <number>'"), ("line 4", "not valid JSON"),
                                 ("line 5", "missing field 'question'")]),
    ("math", "math.json", 3, [("row 2", "no \\boxed{...}"), ("row 4", "missing field 'problem'"),
                              ("row 5", "must be an object")]),
    ("aime", "aime.parquet", 2, [("row 2", "'3/4' is not an AIME answer"), ("row 3", "missing field 'problem'")]),
    ("gpqa", "gpqa.csv", 2, [("row 2", "missing field 'Incorrect Answer 3'")]),
    ("code", "code_contests.parquet", 2, [("row 2", "no test cases"), ("row 3", "2 inputs but 1 outputs")]),
    ("code", "taco.jsonl", 1, [("line 2", "'input_output' is not valid JSON")]),
]


@pytest.mark.parametrize("kind,fixture,num_good,bad", CASES, ids=[case[1] for case in CASES])
def test_every_bad_row_is_named_and_good_rows_validate(kind, fixture, num_good, bad):
    result = prepare([FIXTURES / fixture], kind)
    assert len(result.rows) == num_good
    assert len(result.problems) == len(bad), result.problems
    for problem, (where, fragment) in zip(result.problems, bad):
        assert f"{fixture} {where}: " in problem and fragment in problem, problem
    validate_rows(result.rows, fixture)
    assert [row["extra_info"]["index"] for row in result.rows] == list(range(num_good))


@pytest.mark.parametrize("kind,fixture", [(case[0], case[1]) for case in CASES], ids=[case[1] for case in CASES])
def test_gold_solutions_are_graded_correct_by_the_selected_grader(kind, fixture):
    for row in prepare([FIXTURES / fixture], kind).rows:
        solution = row["extra_info"].get("solution")
        if solution is None:
            continue
        result = compute_score(row["data_source"], solution, row["reward_model"]["ground_truth"], row["extra_info"])
        assert result["acc"], (row, result)


def test_conversions_keep_the_answers_and_solutions():
    gsm8k = prepare([FIXTURES / "gsm8k.jsonl"], "gsm8k").rows
    assert [row["reward_model"]["ground_truth"] for row in gsm8k] == ["72", "10", "5"]
    assert "<<" not in gsm8k[0]["extra_info"]["solution"] and gsm8k[0]["extra_info"]["solution"].endswith("#### 72")
    math_rows = prepare([FIXTURES / "math.json"], "math").rows
    assert [row["reward_model"]["ground_truth"] for row in math_rows] == ["6", "\\frac{2}{3}", "\\sqrt{2}"]
    aime = prepare([FIXTURES / "aime.parquet"], "aime", data_source="aime2025").rows
    assert [row["reward_model"]["ground_truth"] for row in aime] == ["24", "6"]
    assert {row["data_source"] for row in aime} == {"aime2025"} and "solution" not in aime[1]["extra_info"]
    gpqa = prepare([FIXTURES / "gpqa.csv"], "gpqa").rows
    options = json.loads(gpqa[0]["extra_info"]["options"])
    assert options["ABCD".index(gpqa[0]["reward_model"]["ground_truth"])] == "Photon"
    assert prepare([FIXTURES / "gpqa.csv"], "gpqa").rows == gpqa, "option order must be reproducible"
    code = prepare([FIXTURES / "code_contests.parquet"], "code").rows
    assert json.loads(code[0]["reward_model"]["ground_truth"]) == {"inputs": ["1 2\n", "5 7\n"],
                                                                   "outputs": ["3\n", "12\n"]}
    assert "print(a + b)" in code[0]["extra_info"]["solution"] and "solution" not in code[1]["extra_info"]
    taco = prepare([FIXTURES / "taco.jsonl"], "code").rows
    assert json.loads(taco[0]["reward_model"]["ground_truth"])["fn_name"] == "add"


def test_last_boxed_balances_braces():
    assert last_boxed("a \\boxed{1} then \\boxed{\\frac{1}{2}} end") == "\\frac{1}{2}"
    assert last_boxed("\\fbox{7}") == "7" and last_boxed("no box") is None and last_boxed("\\boxed{open") is None


def test_cli_refuses_bad_rows_and_writes_nothing(tmp_path, capsys):
    output = tmp_path / "out.parquet"
    assert main(["--kind", "gsm8k", "--input", str(FIXTURES / "gsm8k.jsonl"), "--output", str(output)]) == 2
    assert not output.exists()
    error = capsys.readouterr().err
    assert "3 bad row(s)" in error and "line 4: not valid JSON" in error and "--skip-bad-rows" in error


def test_cli_skip_bad_rows_writes_a_file_the_dataset_reader_accepts(tmp_path):
    output = tmp_path / "sub" / "math.parquet"
    command = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), "--kind", "math", "--input",
               str(FIXTURES / "math.json"), "--output", str(output), "--skip-bad-rows", "--split", "test"]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=60,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr
    assert "wrote 3 rows" in done.stdout and "row 5: record must be an object" in done.stderr
    rows = read_parquet_rows(output)
    validate_rows(rows, str(output))
    assert {row["extra_info"]["split"] for row in rows} == {"test"}
    extra_info_type = pq.read_schema(output).field("extra_info").type
    assert {extra_info_type.field(i).name for i in range(extra_info_type.num_fields)} == {
        "index", "level", "question", "solution", "split", "type", "unique_id"}


def test_unreadable_inputs_get_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_records(tmp_path / "missing.jsonl")
    (tmp_path / "data.txt").write_text("x")
    with pytest.raises(ValueError, match="unsupported suffix '.txt'"):
        read_records(tmp_path / "data.txt")
    (tmp_path / "scalar.json").write_text("3")
    with pytest.raises(ValueError, match="must hold a list of records"):
        read_records(tmp_path / "scalar.json")
    with pytest.raises(ValueError, match="--kind 'mmlu' is not supported"):
        prepare([FIXTURES / "math.json"], "mmlu")


# Rows built the way verl's examples/data_preprocess/gsm8k.py and math_dataset.py build them.
GSM8K_INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def _verl_gsm8k_rows():
    raw = [json.loads(line) for line in (FIXTURES / "gsm8k.jsonl").read_text().splitlines()[:2]]
    return [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": r["question"] + " " +
                                                        GSM8K_INSTRUCTION}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": r["answer"].split("#### ")[1]},
             "extra_info": {"split": "train", "index": i, "answer": r["answer"], "question": r["question"]}}
            for i, r in enumerate(raw)]


def _verl_math_rows():
    problems = ["What is $1+2+3$?", "Simplify $\\frac{4}{6}$.", "A problem the raw release does not have."]
    return [{"data_source": "DigitalLearningGmbH/MATH-lighteval",
             "prompt": [{"role": "user", "content": problem + " " + MATH_INSTRUCTION}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": answer}, "extra_info": {"split": "test", "index": i}}
            for i, (problem, answer) in enumerate(zip(problems, ["6", "\\frac{2}{3}", "1"]))]


def _write_rows(rows, path):
    import pyarrow as pa

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", ["verl", "gsm8k"])
def test_verl_schema_rows_pass_through_unchanged(tmp_path, kind):
    rows = _verl_gsm8k_rows()
    result = prepare([_write_rows(rows, tmp_path / "train.parquet")], kind)
    assert result.problems == [] and result.rows == rows


def test_broken_verl_rows_are_named(tmp_path):
    rows = _verl_gsm8k_rows()
    rows[1]["reward_model"] = {"style": "rule"}
    rows.append({"question": "a raw record among verl rows", "answer": "#### 1"})
    result = prepare([_write_rows(rows, tmp_path / "train.parquet")], "verl")
    assert len(result.rows) == 1
    assert result.problems[0].endswith("row 1: missing field 'reward_model.ground_truth'")
    assert result.problems[1].endswith("row 2: missing field 'prompt'; missing field 'data_source'; "
                                       "missing field 'reward_model'")  # parquet gives every row every column
    (tmp_path / "mixed.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    result = prepare([tmp_path / "mixed.jsonl"], "verl")
    assert result.problems[1].endswith("line 3: not a verl-schema row: missing field(s) 'data_source', 'prompt', "
                                       "'reward_model'")


def test_cli_attaches_raw_solutions_to_verl_built_rows(tmp_path, capsys):
    from megatron_cpo.data.hints import HintReader

    verl_file = _write_rows(_verl_math_rows(), tmp_path / "math.parquet")
    output = tmp_path / "math_hints.parquet"
    assert main(["--kind", "verl", "--input", str(verl_file), "--output", str(output), "--attach-solutions",
                 str(FIXTURES / "math.json"), "--solutions-kind", "math"]) == 0
    notes = capsys.readouterr().err
    assert "1 of 3 rows found no solution in 3 raw records (rows 2)" in notes
    assert "raw solutions:" in notes and "row 4: missing field 'problem'" in notes and "row 5: record must" in notes
    rows = read_parquet_rows(output)
    validate_rows(rows, str(output))
    assert [row["extra_info"]["solution"] for row in rows] == [
        "Adding, $1+2+3=\\boxed{6}$.", "Divide by 2: $\\boxed{\\frac{2}{3}}$.", None]
    hints, metrics = HintReader().read([r["extra_info"] for r in rows], [r["reward_model"] for r in rows])
    assert hints[0] == "Adding, $1+2+3=\\boxed{6}$." and metrics["cpo/hint_source/extra_info.solution"] == 2.0
    for row in rows[:2]:
        assert compute_score(row["data_source"], row["extra_info"]["solution"], row["reward_model"]["ground_truth"])[
            "acc"]


def test_attach_matches_gsm8k_by_question_and_keeps_existing_solutions(tmp_path):
    from prepare_data import add_solutions

    result = prepare([_write_rows(_verl_gsm8k_rows(), tmp_path / "train.parquet")], "verl")
    result.rows[1]["extra_info"]["solution"] = "kept"
    add_solutions(result, [FIXTURES / "gsm8k.jsonl"], "gsm8k")
    assert result.rows[0]["extra_info"]["solution"].endswith("altogether in April and May.\n#### 72")
    assert "<<" not in result.rows[0]["extra_info"]["solution"] and result.rows[1]["extra_info"]["solution"] == "kept"
    with pytest.raises(ValueError, match="pass --solutions-kind"):
        add_solutions(result, [FIXTURES / "gsm8k.jsonl"], "verl")
