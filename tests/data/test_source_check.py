"""The trainer's data check: rows whose data_source has no grader stop the run before anything loads or starts
(Ray, the engines, the model), unless a custom grader or a reward function covers them; custom graders are read
from `reward.custom_graders` as they are, never registered in the trainer's process."""
import time

import pyarrow as pa
import pyarrow.parquet as pq

from megatron_cpo.config import build_config
from megatron_cpo.rewards import registry
from megatron_cpo.trainer.run import preflight


def data_problems_of(config):
    """`preflight.data_problems` with the sections the trainer's preflight passes it."""
    return preflight.data_problems(config.data, config.reward, config.actor_rollout_ref.rollout.multi_turn)


def _rows(sources):
    return [{"data_source": source, "prompt": [{"role": "user", "content": f"q{i}"}],
             "reward_model": {"style": "rule", "ground_truth": "1"}, "extra_info": {"index": i}}
            for i, source in enumerate(sources)]


def test_trainer_data_check_names_unknown_sources(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(_rows(["openai/gsm8k", "corp/unknown-v2", "lighteval/MATH"])), path)
    started = time.perf_counter()
    problems, rows = data_problems_of(build_config({}, [f"data.train_files={path}"]))
    assert rows == 3 and len(problems) == 1
    assert problems[0].startswith("no grader for data_source 'corp/unknown-v2' in ")
    assert "(corp/unknown-v2: 1 rows)" in problems[0]
    assert time.perf_counter() - started < 30
    assert data_problems_of(build_config({}, [f"data.train_files={path}", "custom_reward_function.path=any.py"])) == (
        [], 3)
    registered = dict(registry._registered)
    custom = build_config({"reward": {"custom_graders": {
        "corp/unknown-v2": "tests.rewards.hostile_graders:exact_match"}}}, [f"data.train_files={path}"])
    assert data_problems_of(custom) == ([], 3)
    assert registry._registered == registered  # checked against the config, not by registering in this process
