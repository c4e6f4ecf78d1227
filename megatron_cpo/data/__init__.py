"""Data: verl-schema parquet prompt datasets, CPO hint contexts and the synthetic arithmetic task.
Names load on first use, so that loading a config (which reads `config.py` here) imports no torch.
"""

import importlib

_LAZY = {
    "DataConfig": "megatron_cpo.data.config",
    **dict.fromkeys(("DataValidationError", "PromptDataset", "PromptRecord", "read_rows", "validate_rows"),
                    "megatron_cpo.data.dataset"),
    **dict.fromkeys(("HintContexts", "HintReader", "HintTemplate", "build_hint_contexts", "find_hint"),
                    "megatron_cpo.data.hints"),
    **dict.fromkeys(("ArithConfig", "generate_arith", "write_arith_parquet"), "megatron_cpo.data.synthetic"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
