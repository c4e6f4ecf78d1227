"""Chat templates of other shapes than the tiny model's, on its character tokenizer (the unit tests render text and
count ids; no model reads them)."""
from __future__ import annotations

from megatron_cpo.models.tiny import build_char_tokenizer

# Qwen2.5's shape: a default system prompt, the tools in the system turn, consecutive tool messages grouped into one
# user turn of <tool_response> blocks, "<|im_end|>\n" closing every turn.
QWEN_STYLE = (
    "{%- if tools %}"
    "{{ '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{%- else %}{{ 'You are a helpful assistant.' }}"
    "{%- endif %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{ '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{ '\\n</tools><|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}"
    "{%- if not tools %}{{ '<|im_start|>system\\n' + message['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\\n<tool_response>\\n' + message['content'] + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}{{ '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Llama 3's shape: nothing after the end-of-turn token.
LLAMA3_STYLE = (
    "{%- for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' + m['content'] + "
    "'<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

# A template that drops the reasoning of assistant turns before the last user turn (as Qwen3's does).
REASONING_DROPPING = (
    "{%- set last = namespace(user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set last.user = loop.index0 %}{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < last.user %}{%- set content = content.split('</think>')[-1] %}"
    "{%- endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


def tokenizer_with(template: str | None = None, special_tokens: tuple[str, ...] = ()):
    tokenizer = build_char_tokenizer()
    if special_tokens:
        tokenizer.add_special_tokens({"additional_special_tokens": list(special_tokens)})
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer
