"""The CPO hint context: the same response, scored after a conversation that already shows the gold solution.

Rendered through the tokenizer's own chat template (docs/cpo.md, "The hint context"); an overlong hint is cut from
the left. A row without a hint is `has_hint=False` and scored as its plain prompt (MI 0). `HintReader` counts the
hint's source and warns when hints are bare answers.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_cpo.data.config import DEFAULT_INSTRUCTION
from megatron_cpo.data.dataset import encode_texts
from megatron_cpo.data.hint_keys import DEFAULT_HINT_KEYS, check_hint_keys

logger = logging.getLogger(__name__)

HINT_SOURCES = DEFAULT_HINT_KEYS
_SLOT = "\u2063HINT\u2063"  # invisible separator: marks where the template placed the hint text


@dataclass
class HintTemplate:
    """How the hint context reads: the hint text (`{solution}` is the gold solution) and the second user turn
    (`{question}`, `{instruction}`). The texts are the seeds' wording, fixed; only the instruction is a setting of the
    run (`data.hint_instruction`), for a task graded on another answer format than `\\boxed{}`."""

    hint_template: str = "{solution}"
    second_turn_template: str = "{question}\n{instruction}"
    instruction: str = DEFAULT_INSTRUCTION

    def __post_init__(self) -> None:
        if "{solution}" not in self.hint_template:
            raise ValueError(f"hint_template={self.hint_template!r} must contain '{{solution}}'")
        if "{question}" not in self.second_turn_template:
            raise ValueError(f"second_turn_template={self.second_turn_template!r} must contain '{{question}}'")


@dataclass
class HintContexts:
    """Hinted prompt ids per row (the plain prompt where `has_hint` is False) and truncation counts."""

    prompt_ids: list[list[int]]
    has_hint: torch.Tensor
    truncated_tokens: torch.Tensor
    source_metrics: dict[str, float] = field(default_factory=dict)

    @property
    def num_truncated(self) -> int:
        """How many hints were cut from the left to fit `max_prompt_length`."""
        return int((self.truncated_tokens > 0).sum())


def find_hint(extra_info: dict[str, Any] | None, reward_model: dict[str, Any] | None,
              keys: tuple[str, ...] | list[str] = DEFAULT_HINT_KEYS) -> tuple[str | None, str | None]:
    """(hint text, the key it was read from): the first non-empty value among ``keys``; (None, None) if none."""
    roots = {"extra_info": extra_info or {}, "reward_model": reward_model or {}}
    for key in keys:
        root, *path = key.split(".")
        value: Any = roots.get(root)
        for name in path:
            value = value.get(name) if isinstance(value, dict) else None
        if value is not None and not isinstance(value, (dict, list)) and str(value).strip():
            return str(value), key
    return None, None


class HintReader:
    """Reads the hints of a batch from ``keys`` (``data.hint_key``), counts their sources and warns once per run
    when some hints are bare answers (the hint equals ``reward_model.ground_truth``)."""

    def __init__(self, keys: tuple[str, ...] | list[str] = DEFAULT_HINT_KEYS) -> None:
        check_hint_keys(keys)
        self.keys = tuple(keys)
        self.warned_bare = False

    def read(self, extra_infos: list[dict[str, Any] | None], reward_models: list[dict[str, Any] | None]
             ) -> tuple[list[str | None], dict[str, float]]:
        """Hints per row and ``cpo/hint_source/<key>`` counts (``none`` for rows without a hint) plus
        ``cpo/hint_bare_answer``, the number of hints that are the bare ground truth."""
        found = [find_hint(e, r, self.keys) for e, r in zip(extra_infos, reward_models)]
        sources = Counter(key or "none" for _, key in found)
        bare = [key for (hint, key), r in zip(found, reward_models)
                if hint is not None and hint.strip() == str((r or {}).get("ground_truth", "")).strip()]
        if bare and not self.warned_bare:
            self.warned_bare = True
            logger.warning(
                "%d of %d CPO hints are the bare answer (read from %s), not a worked solution; CPO then learns from "
                "little more than the answer. Attach solutions (tools/prepare_data.py --attach-solutions) or point "
                "data.hint_key at the field that holds them (now %s). Logged once.",
                len(bare), len(found), ", ".join(sorted(set(bare))), list(self.keys))
        metrics = {f"cpo/hint_source/{key}": float(count) for key, count in sorted(sources.items())}
        metrics["cpo/hint_bare_answer"] = float(len(bare))
        return [hint for hint, _ in found], metrics


def _last_user_question(messages: list[dict[str, str]]) -> str:
    users = [m["content"] for m in messages if m["role"] == "user"]
    if not users:
        raise ValueError(f"cannot build a hint context: the prompt has no user message ({messages!r})")
    return users[-1]


def _split_at_slot(text: str) -> tuple[str, str]:
    parts = text.split(_SLOT)
    if len(parts) != 2:
        raise ValueError("the tokenizer's chat template did not keep the assistant hint turn verbatim (found "
                         f"{len(parts) - 1} copies of it); use a template that renders earlier assistant turns")
    return parts[0], parts[1]


def build_hint_contexts(tokenizer, conversations: list[list[dict[str, str]]], hints: list[str | None],
                        plain_prompt_ids: list[list[int]], max_prompt_length: int,
                        template: HintTemplate | None = None) -> HintContexts:
    """Hinted prompt ids for a batch: conversation + assistant(hint) + user(question, instruction) + generation prompt,
    at most `max_prompt_length` (`data.max_prompt_length`) tokens: a longer hint loses its start.

    `plain_prompt_ids` are used unchanged for rows whose hint is None. Text before and after the hint is tokenized
    in one batched call each; the hint is tokenized on its own so its tokens can be cut from the left exactly.
    `template`: the hint turn's wording (`HintTemplate()` when None).
    """
    template = HintTemplate() if template is None else template
    if not len(conversations) == len(hints) == len(plain_prompt_ids):
        raise ValueError(f"batch sizes differ: {len(conversations)} conversations, {len(hints)} hints, "
                         f"{len(plain_prompt_ids)} prompts")
    hinted = [i for i, hint in enumerate(hints) if hint is not None]
    texts = []
    for i in hinted:
        question = _last_user_question(conversations[i])
        second_turn = template.second_turn_template.format(question=question, instruction=template.instruction)
        messages = [*conversations[i], {"role": "assistant", "content": _SLOT},
                    {"role": "user", "content": second_turn}]
        texts.append(_split_at_slot(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                  tokenize=False)))
    before = encode_texts(tokenizer, [t[0] for t in texts])
    after = encode_texts(tokenizer, [t[1] for t in texts])
    hint_ids = encode_texts(tokenizer, [template.hint_template.format(solution=hints[i]) for i in hinted])

    prompt_ids = [list(ids) for ids in plain_prompt_ids]
    truncated = torch.zeros(len(hints), dtype=torch.long)
    for row, head, tail, hint in zip(hinted, before, after, hint_ids):
        excess = len(head) + len(hint) + len(tail) - max_prompt_length
        if excess > len(hint):
            raise ValueError(f"row {row}: the hint context needs {len(head) + len(tail)} tokens without any hint, more "
                             f"than data.max_prompt_length={max_prompt_length}; raise data.max_prompt_length")
        cut = max(excess, 0)
        prompt_ids[row] = head + hint[cut:] + tail
        truncated[row] = cut
    has_hint = torch.zeros(len(hints), dtype=torch.bool)
    has_hint[hinted] = True
    return HintContexts(prompt_ids=prompt_ids, has_hint=has_hint, truncated_tokens=truncated)

