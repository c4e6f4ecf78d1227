"""`actor_rollout_ref.rollout.multi_turn.*`: verl's names load, bad values are refused with the fix, CPO with
episodes is refused in one line, and the pre-start data check knows which rows need a grader and which environments,
tools and interactions exist."""
from pathlib import Path

import pytest

from megatron_cpo.config import ConfigError, build_config, load_config
from megatron_cpo.envs.frozen_lake import write_frozen_lake_parquet
from megatron_cpo.trainer.run import preflight

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "multi_turn"
PREFIX = "actor_rollout_ref.rollout.multi_turn."


def data_problems_of(config):
    """`preflight.data_problems` with the sections the trainer's preflight passes it."""
    return preflight.data_problems(config.data, config.reward, config.actor_rollout_ref.rollout.multi_turn)


def test_verl_multi_turn_keys_load():
    config = build_config({"actor_rollout_ref": {"rollout": {
        "multi_turn": {"enable": True, "max_assistant_turns": 5, "max_user_turns": None, "max_parallel_calls": 2,
                       "max_tool_response_length": 512, "tool_response_truncate_side": "left",
                       "tool_config_path": None, "interaction_config_path": None, "use_inference_chat_template": False,
                       "tokenization_sanity_check_mode": "disable", "format": "hermes", "num_repeat_rollouts": None},
        "agent": {"default_agent_loop": "frozen_lake", "num_workers": 8}}}}, [])
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert (multi_turn.max_assistant_turns, multi_turn.max_user_turns, multi_turn.check_mode) == (5, None, "off")
    assert multi_turn.default_agent == "frozen_lake" and multi_turn.tool_config_path == ""
    assert not build_config({}, []).actor_rollout_ref.rollout.multi_turn.enable


@pytest.mark.parametrize("override, message", [
    ("max_assistant_turns=0", "max_assistant_turns=0 must be >= 1, or null"),
    ("tool_response_truncate_side=top", "choose one of 'left', 'middle', 'right'"),
    ("tokenization_sanity_check_mode=loose", "tokenization_sanity_check_mode='loose' is not supported"),
    ("format=llama3_json", "format='llama3_json' is not supported; choose one of 'hermes'"),
    ("use_inference_chat_template=true", "token in, token out"),
    ("call_timeout_s=0", "call_timeout_s=0.0 must be > 0"),
])
def test_bad_values_name_the_fix(override, message):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config({}, [PREFIX + override] if key != "use_inference_chat_template" else
                     [PREFIX + override, PREFIX + "enable=true"])


def test_cpo_with_episodes_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        build_config({}, [PREFIX + "enable=true", "algorithm.adv_estimator=cpo"])
    assert "\n" not in str(error.value) and "use grpo" in str(error.value)


def test_the_example_config_is_valid():
    config = load_config(Path(__file__).resolve().parents[2] / "examples" / "tiny" / "arith_retry.yaml")
    multi_turn = config.actor_rollout_ref.rollout.multi_turn
    assert multi_turn.enable and multi_turn.default_agent == "arith_retry" and multi_turn.max_assistant_turns == 2


def test_the_data_check_exempts_self_scoring_environments_and_names_what_is_missing(tmp_path):
    lake = write_frozen_lake_parquet(tmp_path / "lake", num_train=4, num_test=2)
    base = [f"data.train_files={lake['train']}", PREFIX + "enable=true"]
    assert data_problems_of(build_config({}, base))[0] == []  # FrozenLake scores itself: no grader for its source
    problems, _ = data_problems_of(build_config({}, [f"data.train_files={lake['train']}"]))
    assert any("megatron_cpo/frozen_lake" in p for p in problems)  # single-turn, the same rows need one
    tool_rows = f"data.train_files={FIXTURES / 'gsm8k_tool_agent.parquet'}"
    assert data_problems_of(build_config({}, [tool_rows, PREFIX + "enable=true",
                                           f"{PREFIX}tool_config_path={FIXTURES / 'tool_config.yaml'}",
                                           f"{PREFIX}interaction_config_path={FIXTURES / 'interaction_config.yaml'}"]
                                      ))[0] == []
    (tmp_path / "other.yaml").write_text("interaction:\n  - name: other\n    class_name: "
                                         "tests.fixtures.multi_turn.feedback_interaction.ArithFeedbackInteraction\n"
                                         "    config: {wrong_message: no}\n")
    problems, _ = data_problems_of(build_config({}, [tool_rows, PREFIX + "enable=true",
                                                  f"{PREFIX}interaction_config_path={tmp_path / 'other.yaml'}"]))
    assert problems == ["rows name the interactions ['arith_feedback'] (extra_info.interaction_kwargs.name), which "
                        "actor_rollout_ref.rollout.multi_turn.interaction_config_path does not configure"]
    problems, _ = data_problems_of(build_config({}, [*base, PREFIX + "default_agent=no_such:Env",
                                                  f"data.train_files={FIXTURES / 'gsm8k_tool_agent.parquet'}",
                                                  f"{PREFIX}tool_config_path={tmp_path / 'missing.yaml'}"]))
    assert len(problems) == 1 and "tool_config_path" in problems[0] and "cannot be read" in problems[0]
