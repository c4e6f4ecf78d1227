"""Tiny Qwen2 / Llama models with a character-level chat tokenizer, built from configs (nothing is downloaded).

They exist so that the whole loop (Megatron training, vLLM rollout, conversion) runs for real on a CPU. head_dim is
at least 32 because vLLM's CPU attention rejects 16.
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARACTERS = string.printable[:95] + "\n\t"  # digits, letters, punctuation, space, newline, tab

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _byte_level_symbol(byte: int) -> str:
    """The symbol GPT-2's byte-level alphabet uses for a byte (space -> 'Ġ', newline -> 'Ċ', ...)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def build_char_tokenizer():
    """A character-level tokenizer with Qwen-style chat special tokens and a chat template.

    It is a byte-level BPE without merges, so it tokenizes the same whether transformers loads it as the generic
    fast tokenizer or as the model family's own class (AutoTokenizer prefers Qwen2Tokenizer for a qwen2 config).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    symbols = [_byte_level_symbol(ord(c)) for c in CHARACTERS]
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + symbols)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=4096,
    )


def tiny_config(family: str = "qwen2", **overrides):
    """A tiny HF config of the given family ("qwen2": qkv bias, untied; "llama": no bias, tied embeddings)."""
    from transformers import LlamaConfig, Qwen2Config

    common = dict(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=SPECIAL_TOKENS.index("<|im_end|>"),
        pad_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        dtype="float32",
    )
    if family == "qwen2":
        common.update(tie_word_embeddings=False)
        common.update(overrides)
        return Qwen2Config(**common)
    if family == "llama":
        common.update(tie_word_embeddings=True, attention_bias=False, mlp_bias=False, rope_theta=500000.0)
        common.update(overrides)
        return LlamaConfig(**common)
    raise ValueError(f"unknown tiny model family {family!r}; choose 'qwen2' or 'llama'")


def write_tiny_model(out_dir: str | Path, family: str = "qwen2", seed: int = 0, *, random_biases: bool = False,
                     dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Write a randomly initialised tiny model, its tokenizer and generation config to `out_dir` (HF layout).

    transformers initialises biases to zero; `random_biases` draws them (std 0.1) so that a dropped bias shows in the
    logits. The weights are drawn in float32 and saved in `dtype` (which the saved config then declares).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if random_biases:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.1)
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_char_tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size={config.vocab_size}; raise vocab_size")
    tokenizer.save_pretrained(out)
    (out / "megatron_cpo_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return out
