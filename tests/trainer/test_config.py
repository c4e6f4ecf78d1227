"""The config tree: YAML + dotted overrides, seed aliases, and bad values rejected with messages that say the fix."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_cpo.config import ConfigError, build_config, load_config, parse_override


def test_yaml_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_batch_size: 4\nactor_rollout_ref:\n  rollout:\n    n: 8\n"
                    "algorithm:\n  filter_groups:\n    enable: true\n")
    config = load_config(path, ["actor_rollout_ref.actor.optim.lr=2e-5",
                                "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                "trainer.logger=[console]", "algorithm.wrap_method=negonly_mi3_qwen3"])
    assert config.data.train_batch_size == 4
    assert config.actor_rollout_ref.rollout.n == 8
    assert config.algorithm.filter_groups.enable is True
    assert config.actor_rollout_ref.actor.optim.lr == pytest.approx(2e-5)
    assert config.trainer.logger == ["console"]
    assert config.algorithm.cpo.wrap_method == "negonly_mi3_qwen3"


def test_seed_001_aliases_map_to_filter_groups():
    config = build_config({"algorithm": {"use_dynamic_sample": True, "dynamic_sample_max_gen_batches": 3}})
    groups = config.algorithm.filter_groups
    assert (groups.enable, groups.max_num_gen_batches, groups.on_limit) == (True, 3, "use_partial")
    explicit = build_config({"algorithm": {"dynamic_sample_max_gen_batches": 3,
                                           "filter_groups": {"on_limit": "error"}}})
    assert explicit.algorithm.filter_groups.on_limit == "error"


def test_feature_keys_under_verl_ragen_and_ms_swift_names():
    config = build_config({
        "actor_rollout_ref": {"rollout": {"rollout_filter_strategy": "min_p", "rollout_filter_value": 0.8,
                                          "rollout_filter_type": "smallest", "rollout_filter_include_zero": False},
                              "actor": {"filter_loss_scaling": "sqrt", "top_entropy_quantile": 0.2}},
        "reward_model": {"overlong_buffer": {"enable": True, "len": 8, "penalty_factor": 0.5, "log": True}},
        "trainer": {"early_stop": {"enable": True, "window": 3}}})
    rollout, actor = config.actor_rollout_ref.rollout, config.actor_rollout_ref.actor
    assert rollout.rollout_filter_enabled and rollout.rollout_filter_strategy == "min_p"
    assert (rollout.rollout_filter_value, rollout.rollout_filter_type) == (0.8, "smallest")
    assert rollout.rollout_filter_include_zero is False
    assert (actor.filter_loss_scaling, actor.top_entropy_quantile) == ("sqrt", 0.2)
    overlong = config.reward.overlong_buffer  # verl's reward_model.overlong_buffer lands in our reward block
    assert (overlong.enable, overlong.len, overlong.penalty_factor, overlong.log) == (True, 8, 0.5, True)
    assert config.trainer.early_stop.enable and config.trainer.early_stop.window == 3
    assert not build_config({}).actor_rollout_ref.rollout.rollout_filter_enabled


@pytest.mark.parametrize("overrides, expected", [
    (["actor_rollout_ref.rollout.n=1"], "set actor_rollout_ref.rollout.n >= 2"),
    (["data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4"], "not a multiple"),
    (["algorithm.filter_groups.on_limit=partial"], "choose one of 'error', 'use_partial'"),
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator='ppo' is not supported"),
    (["data.train_batch_size=eight"], "data.train_batch_size='eight' is not a valid int"),
    (["data.train_bath_size=8"], "did you mean 'data.train_batch_size'"),
    (["actor_rollout_ref.actor.clip_ratio_low=1.5"], "clip_ratio_low=1.5 must be in [0, 1)"),
    (["trainer.logger=[console,mlflow]"], "trainer.logger entry='mlflow'"),
    (["data.train_batch_size"], "has no '='"),
    (["algorithm.wrap_method=mi4"], "algorithm.cpo.wrap_method='mi4' is not a CPO shaping rule"),
    (["actor_rollout_ref.rollout.max_inflight_prompts=2", "data.train_batch_size=8"], "raise it or set 0"),
    (["actor_rollout_ref.rollout.rollout_filter_strategy=top_q"], "choose one of 'none', 'top_p', 'top_k', 'min_p'"),
    (["actor_rollout_ref.rollout.rollout_filter_strategy=top_k", "actor_rollout_ref.rollout.rollout_filter_value=2.5"],
     "must be a whole number >= 1 for top_k"),
    (["actor_rollout_ref.rollout.rollout_filter_strategy=top_k", "actor_rollout_ref.rollout.rollout_filter_value=8",
      "data.train_batch_size=8"], "lower it below train_batch_size"),
    (["actor_rollout_ref.rollout.rollout_filter_strategy=top_p", "actor_rollout_ref.rollout.rollout_filter_value=0"],
     "must be in (0, 1] for top_p"),
    (["actor_rollout_ref.rollout.rollout_filter_metric=entropy"], "'entropy' metrics need a trainer forward pass"),
    (["actor_rollout_ref.rollout.rollout_filter_type=big"], "choose one of 'largest', 'smallest'"),
    (["actor_rollout_ref.actor.filter_loss_scaling=log"], "choose one of 'none', 'linear', 'sqrt'"),
    (["actor_rollout_ref.actor.top_entropy_quantile=0"], "(1.0 keeps all, e.g. 0.2 for the top 20%)"),
    (["reward.overlong_buffer.enable=true"], "must be > 0 when the buffer is enabled"),
    (["reward_model.overlong_buffer.enable=true", "reward_model.overlong_buffer.len=64",
      "data.max_response_length=32"], "exceeds data.max_response_length=32"),
    (["trainer.early_stop.ratio=0"], "trainer.early_stop.ratio=0.0 must be > 0"),
    (["trainer.early_stop.window=0"], "trainer.early_stop.window=0 must be >= 1"),
    (["actor_rollout_ref.actor.checkpoint.save_contents=[model,hf_model]"], "resume needs them"),
    (["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra,weights]"], "unknown entries"),
    (["actor_rollout_ref.rollout.enable_chunked_prefill=false", "actor_rollout_ref.rollout.max_num_batched_tokens=100"],
     "max_num_batched_tokens=100 is below data.max_prompt_length + data.max_response_length = 160"),
    (["data.truncation=middle"], "data.truncation='middle' is not supported; choose one of 'error', 'left', 'right'"),
    (["actor_rollout_ref.rollout.val_kwargs.n=0"], "actor_rollout_ref.rollout.val_kwargs.n=0 must be >= 1"),
    (["algorithm.kl_penalty=k9"], "algorithm.kl_penalty='k9' is not supported"),
    (["actor_rollout_ref.rollout.gpu_memory_utilization=1.5"], "gpu_memory_utilization=1.5 must be in (0, 1]"),
])
def test_bad_values_are_rejected_with_the_fix(overrides, expected):
    with pytest.raises(ConfigError) as err:
        build_config({}, overrides)
    assert expected in str(err.value)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_override_values_are_yaml():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("+a.b=true") == ("a.b", True)


def test_train_command_reports_a_bad_config_in_one_line(tmp_path, capsys):
    from megatron_cpo.cli import main

    path = tmp_path / "bad.yaml"
    path.write_text("actor_rollout_ref:\n  rollout:\n    n: 1\n")
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--config", str(path)])
    assert exit_info.value.code == 2
    assert "error: actor_rollout_ref.rollout.n=1 cannot form groups" in capsys.readouterr().err


def test_example_configs_are_valid():
    from pathlib import Path

    examples = sorted((Path(__file__).parents[2] / "examples" / "tiny").glob("*_arith.yaml"))
    assert [p.name for p in examples] == ["cpo_arith.yaml", "dapo_arith.yaml", "grpo_arith.yaml", "ppo_arith.yaml"]
    estimators = {p.name: load_config(p).algorithm.adv_estimator for p in examples}
    assert estimators == {"cpo_arith.yaml": "cpo", "dapo_arith.yaml": "grpo", "grpo_arith.yaml": "grpo",
                          "ppo_arith.yaml": "gae"}


def test_dapo_recipes_shape_overlong_responses():
    from pathlib import Path

    examples = Path(__file__).parents[2] / "examples"
    for path in [examples / "tiny" / "dapo_arith.yaml", *sorted(examples.glob("qwen2.5-math-*/dapo.yaml"))]:
        config = load_config(path)
        overlong = config.reward.overlong_buffer
        assert overlong.enable and overlong.penalty_factor == 1.0, path
        assert 0 < overlong.len <= config.data.max_response_length // 3, path  # the last part of the budget only


def test_a_scalar_for_a_list_key_is_a_one_element_list():
    """Issue 12 item 9: `trainer.logger=jsonl` was split into characters ("entry='j' is not supported")."""
    assert build_config({}, ["trainer.logger=jsonl"]).trainer.logger == ["jsonl"]
    with pytest.raises(ConfigError) as err:  # one entry, judged as one: resume needs the other contents
        build_config({}, ["actor_rollout_ref.actor.checkpoint.save_contents=model"])
    assert "save_contents=['model'] leaves out ['optimizer', 'extra']" in str(err.value)
    contents = build_config({}, ["actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]"])
    assert contents.actor_rollout_ref.actor.checkpoint.save_contents == ["model", "optimizer", "extra"]


@pytest.mark.parametrize("override, files", [
    ("data.train_files=[a.parquet,b.parquet]", ["a.parquet", "b.parquet"]),  # verl's list syntax
    ("data.train_files=['/d/a.parquet', '/d/b.parquet']", ["/d/a.parquet", "/d/b.parquet"]),  # verl's GRPO script
    ("data.train_files=a.parquet,b.parquet", ["a.parquet", "b.parquet"]),  # our comma form
    ("data.train_files=a.parquet", ["a.parquet"]),
])
def test_data_files_take_verl_lists(override, files):
    assert build_config({}, [override]).data.train_files == files


def test_data_files_as_a_yaml_list(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_files: [a.parquet, b.parquet]\n  val_files: c.parquet\n")
    config = load_config(path)
    assert (config.data.train_files, config.data.val_files) == (["a.parquet", "b.parquet"], ["c.parquet"])


def test_tuple_lengths_are_checked():
    """Issue 12 item 10: `optim.betas=[0.9]` was accepted and crashed with an IndexError after the engines started."""
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.optim.betas=\[0.9\] must hold 2 values"):
        build_config({}, ["actor_rollout_ref.actor.optim.betas=[0.9]"])
    with pytest.raises(ConfigError, match="must hold 2 values"):
        build_config({}, ["actor_rollout_ref.actor.optim.betas=[0.9,0.95,0.99]"])
    assert build_config({}, ["actor_rollout_ref.actor.optim.betas=[0.8,0.95]"]).actor_rollout_ref.actor.optim.betas \
        == (0.8, 0.95)
    from megatron_cpo.trainer.config import OptimConfig

    with pytest.raises(ConfigError, match="must hold two numbers"):
        OptimConfig(betas=(0.9,))


def test_mapping_values_keep_their_keys_and_verls_reward_function_lands_in_reward():
    config = build_config({"reward": {"grader_kwargs": {"apps": {"limits": {"wall_timeout_s": 2}}},
                                      "custom_graders": {"a.b/c": "m:f"}}},
                          ["reward.grader_kwargs.math500={wrong_score: 0}", "reward.custom_graders.d=n:g",
                           "custom_reward_function.path=grade.py"])
    assert config.reward.grader_kwargs == {"apps": {"limits": {"wall_timeout_s": 2}}, "math500": {"wrong_score": 0}}
    assert config.reward.custom_graders == {"a.b/c": "m:f", "d": "n:g"}
    assert config.reward.reward_function == "grade.py:compute_score"
    with pytest.raises(ConfigError, match="keep one"):
        build_config({}, ["custom_reward_function.path=grade.py", "reward.custom_reward_function=other.py:f"])


def test_loading_a_config_imports_no_torch():
    """Each section is torch-free (the math that reads it loads when it runs), so `--dry-run`, the config reference
    and the tools read a run's config without torch, numpy or the graders; in a fresh interpreter."""
    root = Path(__file__).resolve().parents[2]
    code = ("import sys\n"
            "from megatron_cpo.config import load_config\n"
            "config = load_config('examples/tiny/cpo_arith.yaml', ['algorithm.rollout_correction.rollout_is=token'])\n"
            "assert config.algorithm.shaper.needs_hint_contexts\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'numpy', 'transformers', 'megatron',\n"
            "                                                      'ray', 'vllm', 'math_verify', 'pyarrow'}))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=root, env=dict(os.environ, PYTHONPATH=str(root)),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
