"""Megatron-Core GPT models from Hugging Face configs, HF <-> Megatron weights, and checkpoints.

- families/: one module per supported HF architecture (by `model_type`): its Megatron settings, tensor names and
  refusals; builder.py: the GPTModel of an HF config; tensor_rules.py: which HF tensors make which Megatron parameter
  and how they split; weight_mapping.py: loading and exporting weights one tensor at a time at any TP/PP/EP/ETP;
  conversion_commands.py: the `convert` commands (whole checkpoints HF -> Megatron torch_dist and back) built on it;
  checkpoint.py: torch_dist save/load.
"""
from megatron_cpo.models.builder import build_gpt_model, load_hf_config, padded_vocab_size, unwrap_model
from megatron_cpo.models.checkpoint import load_checkpoint, read_checkpoint_info, save_checkpoint
from megatron_cpo.models.weight_mapping import iter_hf_weights, load_hf_weights
from megatron_cpo.models.inference import forward_logits, greedy_generate

__all__ = ["build_gpt_model", "load_hf_config", "padded_vocab_size", "unwrap_model", "load_hf_weights",
           "iter_hf_weights", "save_checkpoint", "load_checkpoint", "read_checkpoint_info", "forward_logits",
           "greedy_generate"]
