"""Megatron-Core GPT models from Hugging Face configs, HF <-> Megatron weights, and checkpoints: families/ (one module
per HF architecture), builder.py, tensor_rules.py and weight_mapping.py (weights one tensor at a time at any
TP/PP/EP/ETP), conversion_commands.py and checkpoint.py (torch_dist). Names load on first use, so loading a config
imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "builder": ("build_gpt_model", "load_hf_config", "padded_vocab_size", "unwrap_model"),
    "checkpoint": ("load_checkpoint", "read_checkpoint_info", "save_checkpoint"),
    "weight_mapping": ("iter_hf_weights", "load_hf_weights"),
    "inference": ("forward_logits", "greedy_generate"),
})
