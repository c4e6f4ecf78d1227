"""Data: verl-schema parquet prompt datasets, CPO hint contexts and the synthetic arithmetic task."""
from megatron_cpo.data.config import DataConfig
from megatron_cpo.data.dataset import DataValidationError, PromptDataset, PromptRecord, read_rows, validate_rows
from megatron_cpo.data.hints import HintContexts, HintReader, HintTemplate, build_hint_contexts, find_hint
from megatron_cpo.data.synthetic import ArithConfig, generate_arith, write_arith_parquet

__all__ = [
    "ArithConfig", "DataConfig", "DataValidationError", "HintContexts", "HintReader", "HintTemplate", "PromptDataset",
    "PromptRecord", "build_hint_contexts", "find_hint", "generate_arith", "read_rows", "validate_rows",
    "write_arith_parquet",
]
