"""Data: verl-schema parquet prompt datasets, CPO hint contexts and the synthetic arithmetic task.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {
    "config": ("DataConfig",),
    "dataset": ("DataValidationError", "PromptDataset", "PromptRecord", "read_rows", "validate_rows"),
    "hints": ("HintContexts", "HintReader", "HintTemplate", "build_hint_contexts", "find_hint"),
    "synthetic": ("ArithConfig", "generate_arith", "write_arith_parquet"),
})
