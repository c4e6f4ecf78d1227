"""Observation tokens from the chat template, as a difference against the conversation so far (token in, token out).

Sampled ids are kept as the engine returned them; an observation's ids are the template's addition for the new
messages plus the end-of-turn separator the engine never sampled. ``check_conversation`` is verl's
``tokenization_sanity_check_mode``. The rule and its edge cases: docs/multi_turn.md, "Token in, token out".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from megatron_cpo.envs.base import Message

FIXED_BASE: list[Message] = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]


@dataclass
class ObservationTokens:
    ids: list[int]
    text: str
    history_rewritten: bool  # the template re-renders earlier turns; the fixed base was used


class ChatTemplate:
    """The tokenizer's chat template and tokenizer, for one run's episodes (the tool schemas go to every render)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def render(self, messages: list[Message], tools: list[dict] | None, add_generation_prompt: bool) -> str:
        kwargs = {"tools": tools} if tools else {}
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                  tokenize=False, **kwargs)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def prompt_ids(self, messages: list[Message], tools: list[dict] | None) -> list[int]:
        return self.encode(self.render(messages, tools, add_generation_prompt=True))

    def separator(self, prior: str, stop_text: str, content: str) -> str:
        """What the template writes after the end-of-turn token that closes the last assistant turn of `prior`
        (the engine stopped on `stop_text`); when the template closes the turn some other way, the whole closing
        after `content` (the episode's check will report the difference)."""
        core = content.strip()
        end = prior.rfind(stop_text) if stop_text else -1
        after = end + len(stop_text)
        if end >= 0 and not (core and core in prior[after:]):  # the stop token closes the turn's content
            return prior[after:]
        start = prior.rfind(core) if core else -1
        return prior[start + len(core):] if start >= 0 else ""

    def observation(self, history: list[Message], new: list[Message], tools: list[dict] | None,
                    stop_text: str) -> ObservationTokens:
        """The ids that follow the last sampled token of `history`'s last (assistant) turn when `new` is appended,
        ending with the generation prompt of the next assistant turn."""
        prior = self.render(history, tools, add_generation_prompt=False)
        full = self.render(history + new, tools, add_generation_prompt=True)
        separator = self.separator(prior, stop_text, history[-1]["content"])
        rewritten = not full.startswith(prior)
        if rewritten:
            prior = self.render(FIXED_BASE, tools, add_generation_prompt=False)
            full = self.render(FIXED_BASE + new, tools, add_generation_prompt=True)
            if not full.startswith(prior):
                raise ValueError("the chat template renders a conversation's earlier turns differently once a message "
                                 "is appended, even for a fixed one-turn conversation; multi-turn episodes need a "
                                 "template whose renders extend one another")
        text = separator + full[len(prior):]
        return ObservationTokens(self.encode(text), text, rewritten)

    def check_conversation(self, ids: list[int], messages: list[Message], tools: list[dict] | None,
                           ignore_whitespace: bool = False) -> str:
        """`same` when `ids` begin the template's ids of `messages`, `retokenized` when only the text agrees, else
        `differs` (text compared without whitespace with `ignore_whitespace`)."""
        text = self.render(messages, tools, add_generation_prompt=messages[-1].get("role") != "assistant")
        expected = self.encode(text)
        if expected[:len(ids)] == ids:
            return "same"
        ours = self.decode(ids, skip_special_tokens=False)
        if ignore_whitespace:
            ours, text = "".join(ours.split()), "".join(text.split())
        return "retokenized" if text.startswith(ours) else "differs"
