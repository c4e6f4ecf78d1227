"""Tools (hermes tool calls, verl's tool YAML, the calculator, the code sandbox, verl's GSM8K tool), verl-style
interactions without verl, and the tool agent's error observations: malformed calls, unknown tools, missing
arguments, exceptions and timeouts (each answered and counted, the episode goes on)."""
import os
import re
import threading
from pathlib import Path

import pytest

from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.envs import EnvironmentRegistry, MultiTurnConfig, Tool, ToolContext
from megatron_cpo.envs.interactions import AsyncCalls, load_interactions
from megatron_cpo.envs.threads import DaemonThreads
from megatron_cpo.envs.tool_agent import ToolAgentEnvironment
from megatron_cpo.envs.tool_calls import parse_hermes_tool_calls, truncate_tool_response
from megatron_cpo.envs.tools import AnswerCheckTool, CalculatorTool, CodeExecutionTool, evaluate_arithmetic, load_tools
from megatron_cpo.models.tiny import build_char_tokenizer
from megatron_cpo.rewards.sandbox import SandboxConfig

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "multi_turn"


def test_hermes_calls_are_parsed_and_every_malformed_one_is_named():
    text = ('think <tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>'
            '<tool_call>{"name": 3}</tool_call><tool_call>not json</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "x", "arguments": [1]}</tool_call> then <tool_call>{"name": "calc')
    parsed = parse_hermes_tool_calls(text)
    assert [(c.name, c.arguments) for c in parsed.calls] == [("calculator", {"expression": "2+3"}),
                                                            ("calculator", {"expression": "4"})]
    reasons = [m.reason for m in parsed.malformed]
    assert reasons[0] == "no 'name' string" and reasons[1].startswith("not JSON")
    assert "list" in reasons[2] and "'arguments' is a list" in reasons[3] and "never closed" in reasons[4]
    assert not parse_hermes_tool_calls("\\boxed{5}").any


def test_tool_outputs_are_cut_as_verl_cuts_them():
    text = "abcdefghij"
    assert truncate_tool_response(text, 4, "left") == "abcd...(truncated)"
    assert truncate_tool_response(text, 4, "right") == "(truncated)...ghij"
    assert truncate_tool_response(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate_tool_response(text, 10, "middle") == text


def test_the_calculator_evaluates_arithmetic_only():
    assert evaluate_arithmetic("17*3+4") == 55 and evaluate_arithmetic("7/2") == 3.5
    assert evaluate_arithmetic("-(2**3)") == -8
    for bad in ("__import__('os')", "2**1000", "x+1", "[1]"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate_arithmetic(bad)


def test_verl_tool_yaml_loads_our_calculator_and_verls_gsm8k_tool_by_its_class_name():
    tools = load_tools(FIXTURES / "tool_config.yaml")
    assert sorted(tools) == ["calc_gsm8k_reward", "calculator"]
    assert isinstance(tools["calc_gsm8k_reward"], AnswerCheckTool) and isinstance(tools["calculator"], CalculatorTool)
    context = ToolContext(kwargs={"ground_truth": "455"})
    first = tools["calc_gsm8k_reward"].call({"answer": "455"}, context)
    again = tools["calc_gsm8k_reward"].call({"answer": "455"}, context)
    assert "reward=1.0" in first.text and (first.reward, again.reward) == (0.0, -0.05)  # verl's resubmission penalty


def test_bad_tool_configs_name_the_entry_and_the_fix(tmp_path):
    cases = {"tools: []\n": "has no `tools:` list", "tools: [{config: {}}]\n": "tools[0] has no class_name",
             "tools: [{class_name: no.such.Tool}]\n": "cannot import module 'no.such'",
             "tools: [{class_name: megatron_cpo.envs.tools.Tool, tool_schema: {function: {name: a}}}]\n":
                 "abstract", "tools: [{class_name: builtins.dict}]\n": "is not a megatron_cpo.envs.tools.Tool",
             "tools: [{class_name: megatron_cpo.envs.tools.CalculatorTool}, "
             "{class_name: megatron_cpo.envs.tools.CalculatorTool}]\n": "two tools are named 'calculator'"}
    for index, (text, message) in enumerate(cases.items()):
        path = tmp_path / f"tools{index}.yaml"
        path.write_text(text)
        with pytest.raises((ValueError, TypeError), match=re.escape(message)):
            load_tools(path)


def test_code_runs_in_the_sandbox_not_in_the_trainer():
    tool = CodeExecutionTool({"timeout_s": 5}, sandbox=SandboxConfig())  # auto: namespaces where allowed
    assert tool.call({"code": f"import os; print(6 * 7, os.getpid() != {os.getpid()})"},
                     ToolContext()) == "42 True"
    assert "ZeroDivisionError" in tool.call({"code": "1/0"}, ToolContext())


def test_a_verl_style_interaction_class_loads_and_runs_without_verl():
    calls = AsyncCalls()
    [(name, interaction)] = load_interactions(FIXTURES / "interaction_config.yaml", calls).items()
    assert name == "arith_feedback"
    interaction.start("i1", {"ground_truth": "12"})
    done, text, score, _ = interaction.respond("i1", [{"role": "assistant", "content": "#### 13"}], {})
    assert (done, score) == (False, 0.0) and "incorrect" in text
    assert interaction.respond("i1", [{"role": "assistant", "content": "#### 12"}], {})[:1] == (True,)
    assert interaction.score("i1", {}) == 1.0
    interaction.finalize("i1", {})
    calls.close()


class Slow(Tool):
    def default_schema(self) -> dict:
        return {"type": "function", "function": {"name": "slow", "parameters": {"required": []}}}

    def call(self, arguments, context):
        threading.Event().wait(2)
        return "late"


class Broken(Tool):
    def default_schema(self) -> dict:
        return {"type": "function", "function": {"name": "broken", "parameters": {"required": []}}}

    def call(self, arguments, context):
        raise KeyError("disk")


def test_the_tool_agent_answers_every_bad_call_with_an_error_and_counts_it_by_kind():
    tools = {"calculator": CalculatorTool(), "slow": Slow(), "broken": Broken()}
    config = MultiTurnConfig(enable=True, max_parallel_calls=4, call_timeout_s=0.2, max_tool_response_length=200)
    pool = DaemonThreads(4, "test-tools")
    env = ToolAgentEnvironment(tools, {}, config, pool)
    row = type("Row", (), {"messages": [{"role": "user", "content": "q"}], "extra_info": {}})()
    env.reset(row, 0)
    calls = ['{"name": "calculator", "arguments": {"expression": "6*7"}}', '{"name": "slow", "arguments": {}}',
             '{"name": "broken", "arguments": {}}', '{"name": "nope", "arguments": {}}',
             '{"name": "calculator", "arguments": {}}', '{"name": "calculator", "arguments": {"expression": "1"}}']
    result = env.step("".join(f"<tool_call>{c}</tool_call>" for c in calls) + "<tool_call>{bad")
    texts = [m["content"] for m in result.messages]
    assert [m["role"] for m in result.messages] == ["tool"] * 7 and not result.done
    assert texts[0].startswith("Error: malformed tool call")  # malformed calls are answered first
    assert texts[1] == "42" and "did not answer within 0.2 s" in texts[2] and texts[3] == "Error: KeyError: 'disk'"
    assert "no tool named 'nope'" in texts[4] and "needs the arguments ['expression']" in texts[5]
    assert "at most 4 tool call(s)" in texts[6]
    assert result.info["tool_failures"] == {"unparsed/malformed": 1, "slow/timeout": 1, "broken/error": 1,
                                            "nope/unknown_tool": 1, "calculator/invalid_arguments": 1,
                                            "calculator/over_limit": 1}
    assert result.info["tool_calls"] == {"calculator": 3, "slow": 1, "broken": 1, "nope": 1}
    assert env.step("\\boxed{42}").done  # no tool call and no interaction: the episode ends
    pool.shutdown()


def test_rows_pick_their_environment_and_verl_rows_load(tmp_path):
    config = MultiTurnConfig(enable=True, tool_config_path=str(FIXTURES / "tool_config.yaml"),
                             interaction_config_path=str(FIXTURES / "interaction_config.yaml"))
    registry = EnvironmentRegistry(config)
    data = PromptDataset(str(FIXTURES / "gsm8k_tool_agent.parquet"), build_char_tokenizer(),
                         DataConfig(max_prompt_length=512))
    row = data[0]
    assert row.agent_name == "tool_agent" and row.extra_info["interaction_kwargs"]["name"] == "arith_feedback"
    env = registry.factory(row.agent_name)()
    assert env.reset(row, 0) == row.messages and [s["function"]["name"] for s in env.tool_schemas] == \
           ["calculator", "calc_gsm8k_reward"]
    assert env.contexts["calc_gsm8k_reward"].kwargs == {"ground_truth": row.ground_truth}
    wrong = env.step("#### 1")
    assert (wrong.done, wrong.reward, wrong.messages[0]["role"]) == (False, 0.0, "user")
    right = env.step(f"#### {row.ground_truth}")
    assert right.done and right.reward == 1.0
    env.close()
    assert not registry.scores_itself("tool_agent") and registry.scores_itself("frozen_lake")
    with pytest.raises(ValueError, match="cannot import module 'no_such.module'"):
        registry.factory("no_such.module:Env")
    registry.close()


def test_an_environment_named_by_file_path_loads_like_one_named_by_module(tmp_path):
    """Every setting that names a Python object reads it one way (megatron_cpo/import_paths.py): an environment may
    also be `path/to/file.py:Class`, like verl's custom reward file."""
    (tmp_path / "my_env.py").write_text(
        "from megatron_cpo.envs.base import SingleTurnEnvironment\n\n\n"
        "class MyEnvironment(SingleTurnEnvironment):\n    pass\n")
    registry = EnvironmentRegistry(MultiTurnConfig(enable=True))
    try:
        assert registry.environment_class(f"{tmp_path / 'my_env.py'}:MyEnvironment").__name__ == "MyEnvironment"
        with pytest.raises(ValueError, match=r"^the row's agent_name / actor_rollout_ref.rollout.multi_turn."
                                             r"default_agent='.*missing.py:Env': the file .* does not exist"):
            registry.environment_class(f"{tmp_path / 'missing.py'}:Env")
    finally:
        registry.close()
