"""Data: verl-schema parquet prompt datasets, CPO hint contexts and the synthetic arithmetic task."""
from megatron_cpo.data.dataset import (DatasetConfig, DataValidationError, PromptDataset, PromptRecord,
                                       validate_rows)
from megatron_cpo.data.hints import HintConfig, HintContexts, HintReader, build_hint_contexts, find_hint
from megatron_cpo.data.synthetic import ArithConfig, generate_arith, write_arith_parquet

__all__ = [
    "ArithConfig", "DataValidationError", "DatasetConfig", "HintConfig", "HintContexts", "HintReader", "PromptDataset",
    "PromptRecord", "build_hint_contexts", "find_hint", "generate_arith", "validate_rows", "write_arith_parquet",
]
