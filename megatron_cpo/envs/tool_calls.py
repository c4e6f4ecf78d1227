"""Tool calls as the model writes them (hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
format of Qwen's and verl's templates) and tool outputs cut to `max_tool_response_length` (verl's rule).

Parsing never raises: a call that is not JSON, lacks a name or arguments, or is opened and never closed is returned
as a malformed call with the reason, which the tool environment answers with an error observation.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOOL_CALL = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class MalformedCall:
    text: str  # what stood between the tags (or after an unclosed one)
    reason: str


@dataclass
class ParsedCalls:
    calls: list[ToolCall] = field(default_factory=list)
    malformed: list[MalformedCall] = field(default_factory=list)

    @property
    def any(self) -> bool:
        return bool(self.calls or self.malformed)


def _parse_one(body: str) -> ToolCall | MalformedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as err:
        return MalformedCall(body, f"not JSON ({err.msg} at character {err.pos})")
    if not isinstance(value, dict):
        return MalformedCall(body, f"a JSON {type(value).__name__}, not an object with name and arguments")
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not name:
        return MalformedCall(body, "no 'name' string")
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return MalformedCall(body, "'arguments' is a string that is not JSON")
    if not isinstance(arguments, dict):
        return MalformedCall(body, f"'arguments' is a {type(arguments).__name__}, not an object")
    return ToolCall(name, arguments)


def parse_hermes_tool_calls(text: str) -> ParsedCalls:
    """Every `<tool_call>...</tool_call>` of `text`, in order; an unclosed last one is malformed."""
    parsed = ParsedCalls()
    end = 0
    for match in _TOOL_CALL.finditer(text):
        call = _parse_one(match.group(1).strip())
        (parsed.calls if isinstance(call, ToolCall) else parsed.malformed).append(call)
        end = match.end()
    rest = text[end:]
    if TOOL_CALL_START in rest:
        parsed.malformed.append(MalformedCall(rest[rest.index(TOOL_CALL_START) + len(TOOL_CALL_START):],
                                              f"{TOOL_CALL_START} is never closed by {TOOL_CALL_END}"))
    return parsed


def truncate_tool_response(text: str, max_length: int, side: str) -> str:
    """`text` cut to `max_length` characters as verl does: `left` keeps the start, `right` the end, `middle` half of
    each; a marker says that something was cut."""
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]
