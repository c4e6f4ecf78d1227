"""User graders: `reward.custom_graders` (per source) and verl's `custom_reward_function.path`/`.name` (every
source), from the config keys to a real grading pool, and the errors for bad ones."""
import textwrap

import pytest

from megatron_cpo.config import ConfigError, build_config
from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards import RewardConfig, RewardManager

VERL_STYLE_FILE = textwrap.dedent('''
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        """verl's convention: keyword arguments in, a float (or a dict with 'score') out."""
        bonus = 0.5 if extra_info and extra_info.get("bonus") else 0.0
        return float(solution_str.strip() == str(ground_truth)) + bonus

    def graded_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": 2.0, "acc": False, "pred": data_source}
''')


def test_custom_graders_from_yaml_mapping_and_command_line():
    tree = {"reward": {"custom_graders": {"my/set.v1": "tests.rewards.hostile_graders:exact_match"}}}
    config = build_config(tree, ["reward.custom_graders.other/set=tests.rewards.hostile_graders:raises"])
    assert config.reward.custom_graders == {"my/set.v1": "tests.rewards.hostile_graders:exact_match",
                                            "other/set": "tests.rewards.hostile_graders:raises"}
    assert build_config({}, ["reward.custom_graders={a/b: 'm.n:f'}"]).reward.custom_graders == {"a/b": "m.n:f"}
    with pytest.raises(ConfigError, match=r"reward.custom_graders\['a'\]='nofunction' must be 'pkg.module:function'"):
        build_config({}, ["reward.custom_graders={a: nofunction}"])


def test_verl_custom_reward_function_keys_and_the_older_spelling(tmp_path):
    config = build_config({"custom_reward_function": {"path": "/x/reward.py", "name": "my_score"}})
    assert config.reward.reward_function == "/x/reward.py:my_score"
    assert build_config({}, ["custom_reward_function.path=r.py"]).reward.reward_function == "r.py:compute_score"
    assert build_config({}, ["reward.custom_reward_function=pkg.mod:fn"]).reward.reward_function == "pkg.mod:fn"
    assert build_config({}).reward.reward_function == ""
    with pytest.raises(ConfigError, match="keep one"):
        build_config({}, ["custom_reward_function.path=r.py", "reward.custom_reward_function=pkg.mod:fn"])
    with pytest.raises(ConfigError, match="names its function, but reward.custom_reward_function_name"):
        build_config({}, ["reward.custom_reward_function=pkg.mod:fn", "custom_reward_function.name=other"])
    with pytest.raises(ConfigError, match="custom_reward_function.name is empty"):
        build_config({}, ["custom_reward_function.path=r.py", "custom_reward_function.name="])


def test_reward_file_errors_name_the_file_and_function(tmp_path):
    where = "reward.custom_reward_function"
    with pytest.raises(ValueError, match="missing.py' does not exist"):
        import_callable(str(tmp_path / "missing.py") + ":compute_score", where)
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="cannot import the file .*broken.py.*RuntimeError: boom"):
        import_callable(str(tmp_path / "broken.py") + ":compute_score", where)
    (tmp_path / "ok.py").write_text(VERL_STYLE_FILE)
    with pytest.raises(ValueError, match="has no 'nope'"):
        import_callable(str(tmp_path / "ok.py") + ":nope", where)


def test_verl_reward_file_grades_every_source_in_the_pool(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(VERL_STYLE_FILE)
    config = build_config({"custom_reward_function": {"path": str(path)}})
    with RewardManager(RewardConfig(num_workers=1, custom_reward_function=config.reward.reward_function)) as manager:
        result = manager.score(["no/such-source", "openai/gsm8k", "math500"], ["yes", "#### 7", "no"],
                               ["yes", "7", "yes"], [{"bonus": True}, None, {}])
    assert [d["status"] for d in result.details] == ["ok", "ok", "ok"]
    assert result.scores.tolist() == [1.5, 0.0, 0.0]  # the file's rule, not the gsm8k grader's
    assert result.acc.tolist() == [True, False, False]


def test_custom_graders_reach_the_workers_next_to_the_builtins(tmp_path):
    path = tmp_path / "reward.py"
    path.write_text(VERL_STYLE_FILE)
    graders = {"my/set": "tests.rewards.hostile_graders:exact_match", "openai/gsm8k": f"{path}:graded_dict"}
    with RewardManager(RewardConfig(num_workers=1, custom_graders=graders)) as manager:
        result = manager.score(["my/set", "openai/gsm8k", "math500"], ["yes", "#### 7", "\\boxed{2}"],
                               ["yes", "7", "2"])
    assert result.scores.tolist() == [1.0, 2.0, 1.0]  # custom, replaced built-in, untouched built-in
    assert [d["grader"] for d in result.details] == [graders["my/set"], graders["openai/gsm8k"], "compute_math_score"]
    assert result.details[1]["pred"] == "openai/gsm8k"


def test_hint_key_config():
    assert build_config({}).data.hint_key[:3] == ["extra_info.solution", "extra_info.gold_solution",
                                                  "extra_info.answer"]
    assert build_config({}, ["data.hint_key=extra_info.answer"]).data.hint_key == ["extra_info.answer"]
    assert build_config({"data": {"hint_key": ["extra_info.meta.worked", "reward_model.ground_truth"]}}
                        ).data.hint_key == ["extra_info.meta.worked", "reward_model.ground_truth"]
    with pytest.raises(ConfigError, match="data.hint_key entry 'solution' must be a dotted path starting at"):
        build_config({}, ["data.hint_key=[solution]"])
