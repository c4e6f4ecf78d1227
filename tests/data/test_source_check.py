"""The trainer's data check: rows whose data_source has no grader stop the run when the data is loaded (before Ray
and the engines start), unless a custom grader or a reward function covers them."""
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_cpo.config import build_config


def _rows(sources):
    return [{"data_source": source, "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
            for i, source in enumerate(sources)]


def test_trainer_data_load_names_unknown_sources(tmp_path, tokenizer):
    from megatron_cpo.rewards.registry import register_custom_graders
    from megatron_cpo.trainer.rollout_side import load_dataset

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(["openai/gsm8k", "corp/unknown-v2", "lighteval/MATH"])), path)
    config = build_config({}, [f"data.train_files={path}"])
    started = time.perf_counter()
    with pytest.raises(ValueError, match=r"no grader for data_source 'corp/unknown-v2' in .*corp/unknown-v2: 1 rows"):
        load_dataset(str(path), tokenizer, config, shuffle=False)
    assert time.perf_counter() - started < 30
    function = build_config({}, [f"data.train_files={path}", "custom_reward_function.path=any.py"])
    assert len(load_dataset(str(path), tokenizer, function, shuffle=False)) == 3
    custom = build_config({"reward": {"custom_graders": {
        "corp/unknown-v2": "tests.rewards.hostile_graders:exact_match"}}}, [f"data.train_files={path}"])
    register_custom_graders(custom.reward.custom_graders)  # what RankZero does before it loads the data
    assert len(load_dataset(str(path), tokenizer, custom, shuffle=False)) == 3
