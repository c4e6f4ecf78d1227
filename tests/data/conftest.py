"""Fixtures for the data tests: the real tiny tokenizer and real parquet files of the synthetic task."""
from pathlib import Path

import pytest

from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet
from megatron_cpo.models.tiny import write_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), family="qwen2", seed=0)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory) -> dict[str, Path]:
    return write_arith_parquet(tmp_path_factory.mktemp("arith"), ArithConfig(num_train=100, num_test=20, seed=3))
