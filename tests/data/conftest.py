"""Fixtures for the data tests: the real tiny tokenizer and real parquet files of the synthetic task (the tiny model
itself is the suite's `tiny_model_dir`, tests/conftest.py)."""
from pathlib import Path

import pytest

from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    """The tokenizer of the suite's tiny model (tests/conftest.py)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def arith_files(tmp_path_factory) -> dict[str, Path]:
    return write_arith_parquet(tmp_path_factory.mktemp("arith"), ArithConfig(num_train=100, num_test=20, seed=3))
