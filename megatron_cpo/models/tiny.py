"""Tiny models of every supported family with a character-level chat tokenizer, built from configs (nothing is
downloaded), so that the whole loop runs for real on a CPU. Their sizes follow vLLM's CPU kernels (head_dim >= 32,
widths multiples of 32); docs/conversion.md, "Tiny models".
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


FAMILY_SETTINGS = {
    "qwen2": {"tie_word_embeddings": False},
    "llama": {"tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False, "rope_theta": 500000.0},
    "qwen3": {"tie_word_embeddings": False},
    "qwen3_moe": {"tie_word_embeddings": False, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "decoder_sparse_step": 2, "norm_topk_prob": True},
    "qwen2_moe": {"tie_word_embeddings": False, "num_hidden_layers": 4, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 64, "shared_expert_intermediate_size": 96, "decoder_sparse_step": 1,
                  "mlp_only_layers": [0], "norm_topk_prob": False},
    "mixtral": {"tie_word_embeddings": False, "num_hidden_layers": 4, "num_local_experts": 4,
                "num_experts_per_tok": 2, "intermediate_size": 64},
}
# Router weights are drawn with this std (transformers' 0.02 leaves the tiny models' top-k choices near ties, which
# float rounding could flip between implementations).
ROUTER_STD = 1.0


def tiny_config(family: str = "qwen2", **overrides):
    """A tiny HF config of the given family (`FAMILY_SETTINGS`: qwen2 untied with qkv bias, llama tied, qwen3 and the
    MoE families untied); `overrides` replace any field."""
    from transformers import AutoConfig

    if family not in FAMILY_SETTINGS:
        raise ValueError(f"unknown tiny model family {family!r}; choose one of {sorted(FAMILY_SETTINGS)}")
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
    return AutoConfig.for_model(family, **{**common, **FAMILY_SETTINGS[family], **overrides})


def write_tiny_model(out_dir: str | Path, family: str = "qwen2", seed: int = 0, *, random_biases: bool = False,
                     random_norms: bool = False, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """Write a randomly initialised tiny model, its tokenizer and generation config to `out_dir` (HF layout).

    transformers initialises biases to zero; `random_biases` draws them (std 0.1) so that a dropped bias shows in the
    logits; `random_norms` draws the RMSNorm weights (1 + std 0.1; transformers sets them to 1) so that a swapped or
    dropped norm shows too. MoE routers are drawn with std `ROUTER_STD`. The weights are drawn in float32 and saved in
    `dtype` (which the saved config then declares).
    """
    from transformers import AutoModelForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if random_biases and name.endswith(".bias"):
                param.normal_(0.0, 0.1)
            if random_norms and name.endswith(("norm.weight", "layernorm.weight")):
                param.normal_(1.0, 0.1)
            if name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight")):
                param.normal_(0.0, ROUTER_STD)
    model = model.to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = build_char_tokenizer()
    if len(tokenizer) > config.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens but vocab_size={config.vocab_size}; raise vocab_size")
    tokenizer.save_pretrained(out)
    (out / "megatron_cpo_tiny.json").write_text(json.dumps({"family": family, "seed": seed}) + "\n")
    return out
