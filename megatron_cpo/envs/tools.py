"""Tools the model calls between turns: an OpenAI function schema and a call that returns text.

Loaded from verl's tool-config YAML; verl's own GSM8K and code tool class names run our equivalents
(``VERL_TOOL_CLASSES``). A tool is shared by every episode; per-episode state is in ``ToolContext``
(docs/multi_turn.md, "Tools").
"""
from __future__ import annotations

import ast
import operator
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_cpo.envs.base import yaml_entries
from megatron_cpo.import_paths import import_object
from megatron_cpo.rewards.answer_graders import compute_gsm8k_score
from megatron_cpo.rewards.sandbox import SandboxConfig, SandboxLimits, configure_sandbox, run_python


@dataclass
class ToolOutput:
    """A call's text for the model and its reward (added to the turn's reward; None: 0)."""
    text: str
    reward: float | None = None


@dataclass
class ToolContext:
    """What one episode's call of a tool sees: the row's kwargs for this tool and the episode's state for it."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)


def function_schema(name: str, description: str, parameters: dict[str, dict], required: list[str]) -> dict:
    """An OpenAI function schema (`{"type": "function", "function": {...}}`)."""
    return {"type": "function", "function": {"name": name, "description": description, "parameters": {
        "type": "object", "properties": parameters, "required": required}}}


class Tool(ABC):
    """A function the model may call. `config` and `tool_schema` come from the tool-config YAML (a built-in tool
    has a default schema); `call` returns the text the model reads next (or a `ToolOutput` with a reward) and may
    raise: the error becomes the tool's answer."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None) -> None:
        self.config = dict(config or {})
        self.schema = tool_schema or self.default_schema()
        function = self.schema.get("function") if isinstance(self.schema, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"{type(self).__name__}: tool_schema {self.schema!r} needs function.name (OpenAI "
                             "function schema: {type: function, function: {name, description, parameters}})")

    @property
    def name(self) -> str:
        return self.schema["function"]["name"]

    @property
    def required(self) -> list[str]:
        return list(self.schema["function"].get("parameters", {}).get("required", []))

    def default_schema(self) -> dict:
        raise ValueError(f"{type(self).__name__} has no default schema; give tool_schema in the tool config")

    @abstractmethod
    def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolOutput | str:
        """Run the tool on the model's arguments."""


_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of an arithmetic expression (numbers, + - * / // % **, parentheses); anything else is an error."""
    def value(node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > 64:
                raise ValueError(f"exponent {right} is too large (at most 64)")
            return _OPERATORS[type(node.op)](left, right)
        raise ValueError(f"{ast.unparse(node)!r} is not arithmetic (numbers, + - * / // % **, parentheses)")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression.strip(), mode="eval").body)
    return int(result) if isinstance(result, float) and result.is_integer() else result


class CalculatorTool(Tool):
    """`calculator(expression)`: the value of an arithmetic expression."""

    def default_schema(self) -> dict:
        return function_schema("calculator", "Evaluate an arithmetic expression (numbers, + - * / // % **, "
                               "parentheses).", {"expression": {"type": "string", "description": "e.g. 3*(4+5)"}},
                               ["expression"])

    def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        return str(evaluate_arithmetic(str(arguments["expression"])))


class CodeExecutionTool(Tool):
    """`code_interpreter(code)`: runs Python in the code sandbox of `reward.sandbox.*` (rewards/sandbox.py: an OS
    boundary, never the trainer's process) and returns its output. `config`: `timeout_s` (wall time, default 5),
    `memory_mb` (default 512)."""

    def __init__(self, config: dict | None = None, tool_schema: dict | None = None,
                 sandbox: SandboxConfig | None = None) -> None:
        super().__init__(config, tool_schema)
        if sandbox is not None:
            configure_sandbox(sandbox, resolve=False)
        timeout = float(self.config.get("timeout_s", self.config.get("default_timeout", 5.0)))  # verl: default_timeout
        memory = int(self.config.get("memory_mb", self.config.get("memory_limit_mb", 512)))  # verl: memory_limit_mb
        self.limits = SandboxLimits(wall_timeout_s=timeout, cpu_time_s=max(1, int(timeout)), memory_mb=memory)

    def default_schema(self) -> dict:
        return function_schema("code_interpreter", "Run Python code and read what it prints.",
                               {"code": {"type": "string", "description": "the program"}}, ["code"])

    def call(self, arguments: dict[str, Any], context: ToolContext) -> str:
        result = run_python(str(arguments["code"]), limits=self.limits)
        text = result.stdout if result.status == "ok" else f"{result.stdout}{result.stderr}\n[{result.status}]"
        return text.strip() or f"[{result.status}: no output]"


class AnswerCheckTool(Tool):
    """verl's GSM8K tool: grades `answer` against the row's `ground_truth` (`tools_kwargs.<name>.create_kwargs`)
    as the `openai/gsm8k` grader does and says so; its reward is 0 when the answer improved on the episode's best so
    far, else -0.05 (verl's rule against resubmitting)."""

    def default_schema(self) -> dict:
        return function_schema("calc_gsm8k_reward", "Check an answer to the math question (1.0 if correct).",
                               {"answer": {"type": "string", "description": "the final number"}}, ["answer"])

    def call(self, arguments: dict[str, Any], context: ToolContext) -> ToolOutput:
        if "ground_truth" not in context.kwargs:
            raise ValueError(f"the row gives no ground_truth for {self.name} (extra_info.tools_kwargs.{self.name}."
                             "create_kwargs.ground_truth)")
        answer = str(arguments["answer"])
        answer = answer if answer.startswith("####") else f"#### {answer}"
        reward = float(compute_gsm8k_score("openai/gsm8k", answer, str(context.kwargs["ground_truth"]))["score"])
        best = context.state.get("best", 0.0)
        context.state["best"] = max(best, reward)
        return ToolOutput(f"Current parsed answer={arguments['answer']!r} reward={reward}",
                          0.0 if reward > best else -0.05)


VERL_TOOL_CLASSES: dict[str, type[Tool]] = {
    "verl.tools.gsm8k_tool.Gsm8kTool": AnswerCheckTool,
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": CodeExecutionTool,
}
"""verl's tool classes whose YAML entries run our equivalent (verl need not be installed)."""


def load_tools(path: str | Path, sandbox: SandboxConfig | None = None) -> dict[str, Tool]:
    """The tools of a verl tool-config YAML file by name; errors name the file, the entry and the fix."""
    where, entries = yaml_entries(path, "tool_config_path", "tools", "class_name, config, tool_schema")
    tools: dict[str, Tool] = {}
    for index, entry in enumerate(entries):
        class_name = entry["class_name"]
        cls = VERL_TOOL_CLASSES.get(class_name) or import_object(class_name, f"{where}: tools[{index}].class_name")
        if not (isinstance(cls, type) and issubclass(cls, Tool)):
            raise ValueError(f"{where}: tools[{index}].class_name={class_name!r} is not a megatron_cpo.envs.tools.Tool "
                             "subclass")
        kwargs = {"sandbox": sandbox} if issubclass(cls, CodeExecutionTool) else {}
        tool = cls(entry.get("config") or {}, entry.get("tool_schema"), **kwargs)
        if tool.name in tools:
            raise ValueError(f"{where}: two tools are named {tool.name!r}; tool names must be unique")
        tools[tool.name] = tool
    return tools
