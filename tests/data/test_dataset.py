"""Prompt datasets from real parquet files and the real tiny tokenizer: tokenization, the one row check (ground
truths included), truncation."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.dataset import DataValidationError, PromptDataset, row_problems


def _write(tmp_path, rows, name="rows.parquet"):
    path = tmp_path / name
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def _row(question="Compute 1+2. Answer in \\boxed{}.", **changes):
    row = {"data_source": "megatron_cpo/arith",
           "prompt": [{"role": "system", "content": "You are a calculator."}, {"role": "user", "content": question}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": "3"},
           "extra_info": {"index": 0, "split": "train", "level": 1, "solution": "1+2=3\n\\boxed{3}"}}
    row.update(changes)
    return row


def test_records_hold_chat_template_prompt_ids(arith_files, tokenizer):
    dataset = PromptDataset(arith_files["train"], tokenizer)
    assert len(dataset) == 100
    record = dataset[5]
    text = tokenizer.decode(record.prompt_ids)
    assert text.startswith("<|im_start|>system\nYou are a calculator.<|im_end|>\n<|im_start|>user\nCompute ")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert record.data_source == "megatron_cpo/arith"
    assert record.ground_truth == pq.read_table(arith_files["train"]).to_pylist()[5]["reward_model"]["ground_truth"]
    assert record.extra_info["solution"].endswith("\\boxed{" + record.ground_truth + "}")


def test_validator_names_every_bad_row_and_what_is_wrong(tmp_path, tokenizer):
    rows = [
        _row(),
        _row(prompt=[]),
        _row(data_source=""),
        _row(reward_model={"style": "rule", "ground_truth": None}),
        _row(prompt=[{"role": "system", "content": "hi"}]),
        _row(prompt=[{"role": "narrator", "content": "hi"}]),
        _row(prompt=[{"role": "system", "content": "   "}, {"role": "user", "content": ""}]),
    ]
    path = _write(tmp_path, rows)
    with pytest.raises(DataValidationError) as caught:
        PromptDataset([path], tokenizer)
    message = str(caught.value)
    assert f"6 bad row(s) in {path}" in message
    assert "row 1: prompt is an empty list of messages" in message
    assert "row 2: data_source must be a non-empty string, got ''" in message
    assert "row 3: missing field 'reward_model.ground_truth'" in message
    assert "row 4: prompt has no user message" in message
    assert "row 5: prompt[0].role='narrator' is not one of" in message
    assert "row 6: prompt has no message with non-empty content" in message
    assert "row 0" not in message


def test_missing_fields_and_wrong_types_are_named():
    row = _row()
    del row["prompt"]
    assert row_problems(row) == ["missing field 'prompt'"]
    assert row_problems(_row(extra_info="x")) == ["extra_info must be a dict, got str"]
    assert row_problems(_row(prompt=[{"role": "user", "content": 5}])) == [
        "prompt[0].content must be a string, got int"]
    assert row_problems(_row(prompt="Compute 1+2")) == ["prompt must be a list of chat messages, got str"]
    assert row_problems(_row(reward_model={"ground_truth": True})) == [
        "reward_model.ground_truth must be a string or number (or a dict/list such as Search-R1's {'target': [...]}), "
        "got bool"]
    assert row_problems(_row(reward_model={"ground_truth": {"target": ["Paris"]}})) == []


def test_missing_file_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet' does not exist"):
        PromptDataset([str(tmp_path / "nope.parquet")], tokenizer)


def test_overlong_prompt_policies(tmp_path, tokenizer):
    long_question = "Compute " + "1+" * 60 + "1. Answer in \\boxed{}."
    path = _write(tmp_path, [_row(), _row(question=long_question)])
    short_length = len(PromptDataset([path], tokenizer, DataConfig(max_prompt_length=1000))[0].prompt_ids)
    limit = short_length + 10
    with pytest.raises(ValueError, match=rf"row 1: prompt has \d+ tokens > max_prompt_length={limit}"):
        PromptDataset([path], tokenizer, DataConfig(max_prompt_length=limit))
    full = PromptDataset([path], tokenizer, DataConfig(max_prompt_length=1000))[1].prompt_ids
    left = PromptDataset([path], tokenizer, DataConfig(max_prompt_length=limit, truncation="left"))
    assert left[1].prompt_ids == full[-limit:]
    right = PromptDataset([path], tokenizer, DataConfig(max_prompt_length=limit, truncation="right"))
    assert right[1].prompt_ids == full[:limit]
    filtered = PromptDataset([path], tokenizer, DataConfig(max_prompt_length=limit, filter_overlong_prompts=True))
    assert len(filtered) == 1 and filtered.num_filtered == 1
    with pytest.raises(ValueError, match="truncation='middle' is not supported"):
        DataConfig(truncation="middle")


def test_empty_ground_truths_are_refused_unless_one_reward_function_grades_every_response(tmp_path, tokenizer):
    """One rule, read_rows's, for the dataset and the pre-start check: a source's grader compares each response with
    the ground truth, so a blank one could never be graded right; a custom reward function (verl's reward-model
    data keeps the ground truth empty) may not need it."""
    rows = [_row(), _row(reward_model={"style": "rule", "ground_truth": "  "}),
            _row(reward_model={"style": "model", "ground_truth": None})]
    path = _write(tmp_path, rows, "blank.parquet")
    with pytest.raises(DataValidationError) as caught:
        PromptDataset([path], tokenizer)
    message = str(caught.value)
    assert f"2 bad row(s) in {path}" in message
    assert "row 1: reward_model.ground_truth is empty: no response can be graded right against it" in message
    assert "row 2: missing field 'reward_model.ground_truth'" in message
    dataset = PromptDataset([path], tokenizer, needs_ground_truth=False)
    assert [record.ground_truth for record in dataset] == ["3", "  ", None]


def test_files_without_rows_or_prompt_column_are_named(tmp_path, tokenizer):
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(pa.Table.from_pylist([], schema=pa.table({"prompt": [[{"role": "user", "content": "x"}]]}).schema),
                   empty)
    with pytest.raises(DataValidationError, match="empty.parquet: has no rows"):
        PromptDataset([empty], tokenizer)
    with pytest.raises(DataValidationError, match="data.prompt_key='question' is not a column"):
        PromptDataset([_write(tmp_path, [_row()])], tokenizer, DataConfig(prompt_key="question"))


def test_structured_ground_truth_is_kept(tmp_path, tokenizer):
    rows = [_row(data_source="searchR1_nq", reward_model={"style": "rule", "ground_truth": {"target": ["Paris"]}})]
    dataset = PromptDataset([_write(tmp_path, rows, "qa.parquet")], tokenizer)
    assert dataset[0].ground_truth == {"target": ["Paris"]}
