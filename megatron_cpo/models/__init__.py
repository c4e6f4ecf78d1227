"""Megatron-Core GPT models from Hugging Face configs, HF <-> Megatron weights, and checkpoints.

- families/: one module per supported HF architecture (by `model_type`): its Megatron settings, tensor names and
  refusals; builder.py: the GPTModel of an HF config; tensor_rules.py: which HF tensors make which Megatron parameter
  and how they split; weight_mapping.py: loading and exporting weights one tensor at a time at any TP/PP/EP/ETP;
  conversion_commands.py: the `convert` commands (whole checkpoints HF -> Megatron torch_dist and back) built on it;
  checkpoint.py: torch_dist save/load.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "builder": ("build_gpt_model", "load_hf_config", "padded_vocab_size", "unwrap_model"),
    "checkpoint": ("load_checkpoint", "read_checkpoint_info", "save_checkpoint"),
    "weight_mapping": ("iter_hf_weights", "load_hf_weights"),
    "inference": ("forward_logits", "greedy_generate"),
})
