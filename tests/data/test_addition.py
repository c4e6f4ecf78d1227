"""The plain-words addition task of the SmolLM2 example: verl schema read by the dataset reader, held-out questions
never trained on, worked column solutions whose every line is right and that the grader accepts, determinism."""
import re

import pytest

from megatron_cpo.data.addition import DATA_SOURCE, AdditionConfig, generate_addition, main, worked_solution
from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.rewards import compute_score


@pytest.mark.parametrize("a, b, lines", [
    (47, 38, ["Add the ones: 7 + 8 = 15. Write 5 and carry 1.", "Add the tens: 4 + 3 + 1 = 8.", "So 47 + 38 = 85."]),
    (95, 17, ["Add the ones: 5 + 7 = 12. Write 2 and carry 1.", "Add the tens: 9 + 1 + 1 = 11.",
              "So 95 + 17 = 112."]),
    (21, 34, ["Add the ones: 1 + 4 = 5.", "Add the tens: 2 + 3 = 5.", "So 21 + 34 = 55."]),
    (999, 1, ["Add the ones: 9 + 1 = 10. Write 0 and carry 1.", "Add the tens: 9 + 0 + 1 = 10. Write 0 and carry 1.",
              "Add the hundreds: 9 + 0 + 1 = 10.", "So 999 + 1 = 1000."]),
])
def test_worked_solution_works_the_columns(a, b, lines):
    assert worked_solution(a, b).splitlines() == lines


def test_every_step_adds_up_and_the_grader_accepts_the_solution():
    splits = generate_addition(AdditionConfig(num_train=300, num_test=100, digits=3, seed=5))
    for row in splits["train"] + splits["test"]:
        solution = row["extra_info"]["solution"]
        for left, right in re.findall(r": ([\d + ]+) = (\d+)\.", solution):
            assert sum(int(term) for term in left.split(" + ")) == int(right), solution
        a, b = map(int, re.fullmatch(r"What is (\d+) \+ (\d+)\?", row["prompt"][0]["content"]).groups())
        assert 100 <= a <= 999 and 100 <= b <= 999 and row["reward_model"]["ground_truth"] == str(a + b)
        assert compute_score(DATA_SOURCE, solution, row["reward_model"]["ground_truth"])["acc"]


def test_held_out_questions_are_distinct_and_never_trained_on():
    splits = generate_addition(AdditionConfig(num_train=2000, num_test=400))
    question = lambda row: tuple(sorted(map(int, re.findall(r"\d+", row["prompt"][0]["content"]))))  # noqa: E731
    test = [question(row) for row in splits["test"]]
    assert len(set(test)) == 400 and not set(test) & {question(row) for row in splits["train"]}
    assert generate_addition(AdditionConfig(num_train=2000, num_test=400)) == splits
    assert generate_addition(AdditionConfig(num_train=2000, num_test=400, seed=1)) != splits
    with pytest.raises(ValueError, match="num_test=3000 is too many"):
        AdditionConfig(num_test=3000)


def test_written_files_load_as_training_data(tmp_path, capsys):
    from megatron_cpo.models.tiny import build_char_tokenizer

    main(["--out", str(tmp_path), "--num-train", "40", "--num-test", "10"])
    assert "wrote test" in capsys.readouterr().out
    data = PromptDataset(tmp_path / "train.parquet", build_char_tokenizer(), DataConfig(max_prompt_length=64))
    assert len(data) == 40
    record = data[0]
    assert record.data_source == DATA_SOURCE and record.messages[0]["role"] == "user"
    assert record.extra_info["solution"].startswith("Add the ones:")
