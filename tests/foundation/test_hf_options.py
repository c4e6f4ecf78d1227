"""Every HF config option that changes the forward is honoured or refused with one line (no distributed setup needed).

The honoured ones are checked against transformers' logits in test_checkpoints_and_options.py; here: the refusals,
the mapping of RoPE variants and sliding windows onto Megatron arguments, the default dtype, and that the docs list
every audited option.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from megatron_cpo.models.builder import build_gpt_model, linear_biases
from megatron_cpo.models.conversion_commands import config_dtype
from megatron_cpo.models.hf_options import OPTIONS, rope_settings, sliding_window_settings
from megatron_cpo.models.tiny import tiny_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("overrides, expected", [
    # transformers slides the layers at or past max_window_layers; query i sees keys i-4..i for a window of 5
    ({"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
     {"window_size": (4, 0), "window_attn_skip_freq": [0, 1]}),
    ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0},
     {"window_size": (2, 0), "window_attn_skip_freq": [1, 1]}),
    ({"use_sliding_window": True, "sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]},
     {"window_size": (2, 0), "window_attn_skip_freq": [1, 0]}),
    ({"use_sliding_window": False, "sliding_window": 3, "max_window_layers": 0}, {}),  # transformers drops the window
    ({"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2}, {}),  # no layer index >= 2 of 2
])
def test_sliding_window_maps_to_megatron_window(overrides, expected):
    assert sliding_window_settings(tiny_config("qwen2", **overrides)) == expected


@pytest.mark.parametrize("parameters, message", [
    ({"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}, r"rope_type='dynamic'"),
    ({"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}, r"rope_type='yarn'"),
    ({"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}, r"partial_rotary_factor=0.5"),
])
def test_unsupported_rope_is_refused_naming_it(parameters, message):
    with pytest.raises(ValueError, match=message):
        build_gpt_model(tiny_config("llama", rope_parameters=parameters))  # before any process group is needed


def test_linear_rope_maps_to_position_interpolation():
    config = tiny_config("llama", rope_parameters={"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0})
    assert rope_settings(config) == {"rotary_base": 5e5, "rope_scaling": False, "seq_len_interpolation_factor": 2.0}


@pytest.mark.parametrize("family, overrides, expected", [
    ("qwen2", {}, (True, False, False)),
    ("llama", {}, (False, False, False)),
    ("llama", {"attention_bias": True}, (True, True, False)),
    ("llama", {"mlp_bias": True}, (False, False, True)),
])
def test_linear_biases_follow_the_config(family, overrides, expected):
    biases = linear_biases(tiny_config(family, **overrides))
    assert (biases.qkv, biases.attention_output, biases.mlp) == expected


def test_default_dtype_is_the_configs():
    assert config_dtype(tiny_config("qwen2", dtype="bfloat16")) == "bfloat16"
    assert config_dtype(tiny_config("qwen2", dtype=torch.float16)) == "float16"
    assert config_dtype(tiny_config("qwen2")) == "float32"


def test_convert_command_refuses_an_option_in_one_line(tmp_path, capsys):
    from megatron_cpo.cli import main

    tiny_config("llama", rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}).save_pretrained(
        tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(["convert-hf-to-mcore", "--hf", str(tmp_path), "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert errors == ["error: unsupported RoPE scaling rope_type='dynamic'; supported: ['default', 'linear', 'llama3']"]
    assert not (tmp_path / "out").exists()


def test_docs_list_every_audited_option():
    from megatron_cpo.models.families import FAMILIES

    docs = (REPO / "docs" / "conversion.md").read_text()
    options = [*OPTIONS, *(option for family in FAMILIES.values() for option in family.options)]
    assert [option.name for option in options if option.name not in docs] == []
    assert all(f"`model_type` `{name}`" in docs for name in FAMILIES)
