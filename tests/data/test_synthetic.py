"""The synthetic arithmetic task: verl schema, determinism, levels, gold solutions that evaluate to the answer."""
import re

import pyarrow.parquet as pq
import pytest

from megatron_cpo.data.synthetic import DATA_SOURCE, LEVELS, ArithConfig, generate_arith, main, write_arith_parquet


def _last_boxed(text: str) -> str:
    return re.findall(r"\\boxed\{([^{}]*)\}", text)[-1]


def test_parquet_has_verl_schema(arith_files):
    table = pq.read_table(arith_files["train"])
    assert set(table.column_names) == {"data_source", "prompt", "ability", "reward_model", "extra_info"}
    rows = table.to_pylist()
    assert len(rows) == 100
    for row in rows:
        assert row["data_source"] == DATA_SOURCE
        assert [m["role"] for m in row["prompt"]] == ["system", "user"]
        assert "\\boxed{}" in row["prompt"][1]["content"]
        assert row["reward_model"]["style"] == "rule"
        assert row["extra_info"]["split"] == "train"
        assert _last_boxed(row["extra_info"]["solution"]) == row["reward_model"]["ground_truth"]
    assert [row["extra_info"]["index"] for row in rows] == list(range(100))


def test_deterministic_by_seed_and_seed_matters():
    first = generate_arith(ArithConfig(num_train=50, num_test=10, seed=7))
    again = generate_arith(ArithConfig(num_train=50, num_test=10, seed=7))
    other = generate_arith(ArithConfig(num_train=50, num_test=10, seed=8))
    assert first == again
    assert first["train"] != other["train"]


def test_every_level_is_present_and_its_steps_are_true_arithmetic():
    rows = generate_arith(ArithConfig(num_train=500, num_test=0))["train"]
    assert {row["extra_info"]["level"] for row in rows} == set(LEVELS)
    for row in rows:
        solution = row["extra_info"]["solution"]
        for left, right in re.findall(r"^([0-9+*]+)=(\d+)$", solution, flags=re.M):
            assert eval(left) == int(right), solution  # the expressions are digits, + and * only
        question = re.search(r"Compute (.+)\. ", row["prompt"][1]["content"]).group(1)
        assert eval(question) == int(row["reward_model"]["ground_truth"])
        assert 5 <= len(solution) <= 80


def test_levels_get_harder():
    rows = generate_arith(ArithConfig(num_train=500, num_test=0))["train"]
    mean_length = {level: 0.0 for level in LEVELS}
    for level in LEVELS:
        lengths = [len(r["extra_info"]["solution"]) for r in rows if r["extra_info"]["level"] == level]
        mean_length[level] = sum(lengths) / len(lengths)
    assert mean_length[1] < mean_length[2] < mean_length[5]


def test_test_questions_are_held_out_of_train():
    splits = generate_arith(ArithConfig(num_train=2000, num_test=100, levels=[3, 5]))
    train_questions = {row["prompt"][1]["content"] for row in splits["train"]}
    assert not any(row["prompt"][1]["content"] in train_questions for row in splits["test"])


def test_unknown_level_is_rejected():
    with pytest.raises(ValueError, match=r"levels=\[1, 9\] holds unknown levels \[9\]"):
        ArithConfig(levels=[1, 9])


def test_cli_writes_both_splits(tmp_path, capsys):
    main(["--out", str(tmp_path), "--num-train", "12", "--num-test", "4", "--levels", "1", "2", "--seed", "1"])
    assert pq.read_table(tmp_path / "train.parquet").num_rows == 12
    test_rows = pq.read_table(tmp_path / "test.parquet").to_pylist()
    assert {row["extra_info"]["level"] for row in test_rows} == {1, 2}
    assert "wrote train" in capsys.readouterr().out


def test_keep_levels_writes_a_subset_of_the_full_generation(tmp_path):
    full = generate_arith(ArithConfig(num_train=40, num_test=10, seed=2))
    paths = write_arith_parquet(tmp_path, ArithConfig(num_train=40, num_test=10, seed=2), keep_levels=[1, 2])
    kept = pq.read_table(paths["test"]).to_pylist()
    assert kept == [row for row in full["test"] if row["extra_info"]["level"] in (1, 2)]
    with pytest.raises(ValueError, match=r"keep_levels=\[7\] must be a non-empty subset"):
        write_arith_parquet(tmp_path, keep_levels=[7])
