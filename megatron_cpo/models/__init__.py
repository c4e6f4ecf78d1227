"""Megatron-Core GPT models from Hugging Face configs, HF <-> Megatron weight conversion, and checkpoints."""
from megatron_cpo.models.builder import build_gpt_model, load_hf_config, padded_vocab_size, unwrap_model
from megatron_cpo.models.checkpoint import load_checkpoint, read_checkpoint_info, save_checkpoint
from megatron_cpo.models.conversion import iter_hf_weights, load_hf_weights
from megatron_cpo.models.inference import forward_logits, greedy_generate

__all__ = ["build_gpt_model", "load_hf_config", "padded_vocab_size", "unwrap_model", "load_hf_weights",
           "iter_hf_weights", "save_checkpoint", "load_checkpoint", "read_checkpoint_info", "forward_logits",
           "greedy_generate"]
