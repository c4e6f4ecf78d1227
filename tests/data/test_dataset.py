"""Prompt datasets from real parquet files and the real tiny tokenizer: tokenization, validation, truncation,
and the data-source check."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_cpo.data.dataset import (DataValidationError, DatasetConfig, PromptDataset, row_problems)


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
    dataset = PromptDataset(DatasetConfig(files=[str(arith_files["train"])]), tokenizer)
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
        PromptDataset(DatasetConfig(files=[path]), tokenizer)
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
    assert row_problems(_row(prompt=[{"role": "user", "content": 5}])) == ["prompt[0].content must be a string, got int"]
    assert row_problems(_row(prompt="Compute 1+2")) == ["prompt must be a list of chat messages, got str"]
    assert row_problems(_row(reward_model={"ground_truth": True})) == [
        "reward_model.ground_truth must be a string or number (or a dict/list such as Search-R1's {'target': [...]}), "
        "got bool"]
    assert row_problems(_row(reward_model={"ground_truth": {"target": ["Paris"]}})) == []


def test_missing_file_is_a_clear_error(tokenizer, tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.parquet' does not exist"):
        PromptDataset(DatasetConfig(files=[str(tmp_path / "nope.parquet")]), tokenizer)


def test_overlong_prompt_policies(tmp_path, tokenizer):
    long_question = "Compute " + "1+" * 60 + "1. Answer in \\boxed{}."
    path = _write(tmp_path, [_row(), _row(question=long_question)])
    short_length = len(PromptDataset(DatasetConfig(files=[path], max_prompt_length=1000), tokenizer)[0].prompt_ids)
    limit = short_length + 10
    with pytest.raises(ValueError, match=rf"row 1: prompt has \d+ tokens > max_prompt_length={limit}"):
        PromptDataset(DatasetConfig(files=[path], max_prompt_length=limit), tokenizer)
    full = PromptDataset(DatasetConfig(files=[path], max_prompt_length=1000), tokenizer)[1].prompt_ids
    left = PromptDataset(DatasetConfig(files=[path], max_prompt_length=limit, truncation="left"), tokenizer)
    assert left[1].prompt_ids == full[-limit:]
    right = PromptDataset(DatasetConfig(files=[path], max_prompt_length=limit, truncation="right"), tokenizer)
    assert right[1].prompt_ids == full[:limit]
    filtered = PromptDataset(DatasetConfig(files=[path], max_prompt_length=limit, filter_overlong_prompts=True),
                             tokenizer)
    assert len(filtered) == 1 and filtered.num_filtered == 1
    with pytest.raises(ValueError, match="truncation='middle' is not supported"):
        DatasetConfig(files=[path], truncation="middle")


def test_unknown_data_source_stops_the_load_with_the_fix(tmp_path, tokenizer):
    from megatron_cpo.rewards.registry import register_grader

    rows = [_row(), _row(data_source="my/private-set"), _row(data_source="my/private-set"), _row(data_source="x.y")]
    path = _write(tmp_path, rows, "unknown.parquet")
    with pytest.raises(ValueError) as error:
        PromptDataset(DatasetConfig(files=[path]), tokenizer)
    message = str(error.value)
    assert message.startswith("no grader for data_source 'my/private-set', 'x.y' in ")
    assert "my/private-set: 2 rows, x.y: 1 rows" in message and path in message
    assert "reward.custom_graders={'my/private-set': 'pkg.module:fn'}" in message
    assert "custom_reward_function.path=" in message
    assert len(PromptDataset(DatasetConfig(files=[path], check_graders=False), tokenizer)) == 4
    for source in ("my/private-set", "x.y"):
        register_grader(source, "tests.rewards.hostile_graders:exact_match", overwrite=True)
    assert len(PromptDataset(DatasetConfig(files=[path]), tokenizer)) == 4


def test_structured_ground_truth_is_kept(tmp_path, tokenizer):
    rows = [_row(data_source="searchR1_nq", reward_model={"style": "rule", "ground_truth": {"target": ["Paris"]}})]
    dataset = PromptDataset(DatasetConfig(files=[_write(tmp_path, rows, "qa.parquet")]), tokenizer)
    assert dataset[0].ground_truth == {"target": ["Paris"]}
