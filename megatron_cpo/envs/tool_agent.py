"""verl's `tool_agent`: the model's turn either calls tools (their outputs are the next observation) or, without a
tool call, is answered by the row's interaction (its reply is the next user turn; its score the turn's reward) or
ends the episode. The final reward comes from the data source's grader on the last answer, as in verl.

Malformed calls, unknown tools, missing arguments, exceptions and timeouts are answered with an error tool message and
counted by kind in `info["tool_failures"]` (`<tool>/<kind>`); the episode goes on.
"""
from __future__ import annotations

import concurrent.futures
import time
import uuid
from collections import Counter
from typing import Any

from megatron_cpo.envs.base import Message, StepResult, TextEnvironment
from megatron_cpo.envs.config import MultiTurnConfig
from megatron_cpo.envs.interactions import Interaction
from megatron_cpo.envs.threads import DaemonThreads
from megatron_cpo.envs.tool_calls import ToolCall, parse_hermes_tool_calls, truncate_tool_response
from megatron_cpo.envs.tools import Tool, ToolContext, ToolOutput


def tool_kwargs(extra_info: dict, name: str) -> dict[str, Any]:
    """The row's kwargs for one tool: verl's `tools_kwargs.<name>.create_kwargs` and `.execute_kwargs`, merged (a
    flat mapping is taken as it is)."""
    entry = (extra_info.get("tools_kwargs") or {}).get(name) or {}
    if "create_kwargs" in entry or "execute_kwargs" in entry:
        return {**(entry.get("create_kwargs") or {}), **(entry.get("execute_kwargs") or {})}
    return dict(entry)


def choose_interaction(interactions: dict[str, Interaction], extra_info: dict) -> tuple[Interaction | None, dict]:
    """The row's interaction (`extra_info.interaction_kwargs.name`, or the only one configured) and its kwargs."""
    kwargs = dict(extra_info.get("interaction_kwargs") or {})
    if not interactions:
        return None, kwargs
    name = kwargs.get("name") or (next(iter(interactions)) if len(interactions) == 1 else None)
    if name not in interactions:
        raise ValueError(f"extra_info.interaction_kwargs.name={name!r} names no configured interaction (configured: "
                         f"{sorted(interactions)}); set it in the row or configure that interaction")
    return interactions[name], kwargs


class ToolAgentEnvironment(TextEnvironment):
    """Tools (by name) and interactions (by name) of the run, for one episode."""

    error_role = "tool"

    def __init__(self, tools: dict[str, Tool], interactions: dict[str, Interaction], config: MultiTurnConfig,
                 tool_pool: DaemonThreads) -> None:
        self.tools, self.interactions, self.config, self.tool_pool = tools, interactions, config, tool_pool
        self.tool_schemas = [tool.schema for tool in tools.values()]
        self.instance_id = uuid.uuid4().hex
        self.messages: list[Message] = []
        self.contexts: dict[str, ToolContext] = {}
        self.interaction: Interaction | None = None
        self.interaction_kwargs: dict[str, Any] = {}

    def reset(self, record: Any, seed: int) -> list[Message]:
        extra_info = record.extra_info or {}
        self.contexts = {name: ToolContext(kwargs=tool_kwargs(extra_info, name)) for name in self.tools}
        self.interaction, self.interaction_kwargs = choose_interaction(self.interactions, extra_info)
        if self.interaction is not None:
            self.interaction.start(self.instance_id, self.interaction_kwargs)
        self.messages = super().reset(record, seed)
        return [dict(message) for message in self.messages]

    def step(self, action_text: str) -> StepResult:
        self.messages.append({"role": "assistant", "content": action_text})
        parsed = parse_hermes_tool_calls(action_text)
        if parsed.any:
            result = self._run_tools(parsed.calls, [call.reason for call in parsed.malformed])
        elif self.interaction is not None:
            done, text, score, metadata = self.interaction.respond(self.instance_id, list(self.messages),
                                                                   self.interaction_kwargs)
            result = StepResult([{"role": "user", "content": text}], score, done, {"interaction": metadata})
        else:
            result = StepResult([], done=True)
        self.messages += result.messages
        return result

    def _run_tools(self, calls: list[ToolCall], malformed: list[str]) -> StepResult:
        """Run at most `max_parallel_calls` calls at once, each within `call_timeout_s`; one tool message each."""
        counts, failures = Counter(), Counter()
        answers: list[str] = []
        reward = 0.0
        for reason in malformed:
            failures["unparsed/malformed"] += 1
            answers.append(f"Error: malformed tool call ({reason}); write <tool_call>{{\"name\": ..., "
                           "\"arguments\": {...}}</tool_call>")
        limit = self.config.max_parallel_calls
        futures = {}
        for position, call in enumerate(calls):
            counts[call.name] += 1
            problem = self._call_problem(call, position, limit)
            if problem is not None:
                failures[f"{call.name}/{problem[0]}"] += 1
                answers.append(problem[1])
                continue
            futures[len(answers)] = (call, self.tool_pool.submit(self.tools[call.name].call, call.arguments,
                                                                 self.contexts[call.name]))
            answers.append("")
        deadline = time.monotonic() + self.config.call_timeout_s  # the calls run in parallel: one deadline for all
        for slot, (call, future) in futures.items():
            try:
                output = future.result(timeout=max(0.0, deadline - time.monotonic()))
            except concurrent.futures.TimeoutError:
                failures[f"{call.name}/timeout"] += 1
                answers[slot] = f"Error: tool {call.name} did not answer within {self.config.call_timeout_s:g} s"
                continue
            except Exception as err:  # noqa: BLE001 - a failing tool is an answer to the model, never a crash
                failures[f"{call.name}/error"] += 1
                answers[slot] = f"Error: {type(err).__name__}: {err}"
                continue
            output = output if isinstance(output, ToolOutput) else ToolOutput(str(output))
            reward += float(output.reward or 0.0)
            answers[slot] = output.text
        messages = [{"role": "tool", "content": truncate_tool_response(text, self.config.max_tool_response_length,
                                                                       self.config.tool_response_truncate_side)}
                    for text in answers]
        return StepResult(messages, reward, False, {"tool_calls": dict(counts), "tool_failures": dict(failures)})

    def _call_problem(self, call: ToolCall, position: int, limit: int) -> tuple[str, str] | None:
        """(failure kind, error message) when the call cannot run."""
        if call.name not in self.tools:
            return "unknown_tool", f"Error: no tool named {call.name!r}; the tools are {sorted(self.tools)}"
        missing = [name for name in self.tools[call.name].required if name not in call.arguments]
        if missing:
            return "invalid_arguments", f"Error: tool {call.name} needs the arguments {missing}"
        if position >= limit:
            return "over_limit", f"Error: at most {limit} tool call(s) run per turn; this one did not run"
        return None

    def close(self) -> None:
        if self.interaction is not None:
            self.interaction.finalize(self.instance_id, self.interaction_kwargs)
