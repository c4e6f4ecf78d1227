"""Megatron-Core GPT models from Hugging Face configs, HF <-> Megatron weights, and checkpoints.

- families/: one module per supported HF architecture (by `model_type`): its Megatron settings, tensor names and
  refusals; builder.py: the GPTModel of an HF config; tensor_rules.py: which HF tensors make which Megatron parameter
  and how they split; weight_mapping.py: loading and exporting weights one tensor at a time at any TP/PP/EP/ETP;
  conversion_commands.py: the `convert` commands (whole checkpoints HF -> Megatron torch_dist and back) built on it;
  checkpoint.py: torch_dist save/load.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""

import importlib

_LAZY = {
    **dict.fromkeys(("build_gpt_model", "load_hf_config", "padded_vocab_size", "unwrap_model"),
                    "megatron_cpo.models.builder"),
    **dict.fromkeys(("load_checkpoint", "read_checkpoint_info", "save_checkpoint"), "megatron_cpo.models.checkpoint"),
    **dict.fromkeys(("iter_hf_weights", "load_hf_weights"), "megatron_cpo.models.weight_mapping"),
    **dict.fromkeys(("forward_logits", "greedy_generate"), "megatron_cpo.models.inference"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
