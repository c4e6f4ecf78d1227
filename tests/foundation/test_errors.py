"""Bad input fails early with a message that names the offending value and the fix (no distributed setup needed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_cpo.models.builder import build_gpt_model, check_parallel_sizes, load_hf_config, rope_settings
from megatron_cpo.models.checkpoint import read_checkpoint_info
from megatron_cpo.models.conversion_commands import convert_mcore_to_hf
from megatron_cpo.models.tiny import tiny_config
from megatron_cpo.models.weight_mapping import SafetensorsReader

REPO = Path(__file__).resolve().parents[2]


def test_unsupported_architecture():
    from transformers import GPT2Config

    expected = r"unsupported architecture model_type='gpt2'.*supported: qwen2 \(Qwen2/Qwen2.5\), llama .*mixtral"
    with pytest.raises(ValueError, match=expected):
        build_gpt_model(GPT2Config())


def test_refused_architecture_says_what_is_missing():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match=r"model_type='deepseek_v3' is not supported: .*multi-latent attention"):
        build_gpt_model(AutoConfig.for_model("deepseek_v3"))


def test_unsupported_activation_and_rope_scaling():
    with pytest.raises(ValueError, match=r"hidden_act='gelu'.*SwiGLU"):
        build_gpt_model(tiny_config("llama", hidden_act="gelu"))
    yarn = tiny_config("qwen2", rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_type='yarn'"):
        rope_settings(yarn)


def test_llama3_rope_scaling_maps_to_megatron():
    scaled = tiny_config("llama", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 8192})
    assert rope_settings(scaled) == {"rotary_base": 5e5, "rope_scaling": True, "rope_scaling_factor": 8.0}
    scaled.rope_parameters["high_freq_factor"] = 2.0
    with pytest.raises(ValueError, match="high_freq_factor"):
        rope_settings(scaled)


@pytest.mark.parametrize("tp, pp, message", [
    (3, 1, r"TP=3 does not divide num_attention_heads=4"),
    (4, 1, r"TP=4 does not divide num_key_value_heads=2"),
    (1, 3, r"PP=3 does not divide num_hidden_layers=2"),
])
def test_parallel_sizes_that_do_not_divide_the_model(tp, pp, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_sizes(tiny_config("qwen2"), tp, pp)


@pytest.mark.parametrize("family, ep, etp, message", [
    ("qwen3_moe", 3, None, r"EP=3 does not divide the 4 experts"),
    ("qwen3_moe", 1, 3, r"ETP=3 does not divide the expert width moe_intermediate_size=64"),
    ("qwen3", 2, None, r"EP=2, ETP=1 split experts, but model_type='qwen3' is dense"),
])
def test_expert_sizes_that_do_not_divide_the_model(family, ep, etp, message):
    with pytest.raises(ValueError, match=message):
        check_parallel_sizes(tiny_config(family), 1, 1, ep, etp)


@pytest.mark.parametrize("family, overrides, message", [
    ("qwen3_moe", {"attention_bias": True}, r"attention_bias=True is not supported for Qwen3-MoE"),
    ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 is not supported"),
    ("qwen2_moe", {"shared_expert_intermediate_size": 0}, r"shared_expert_intermediate_size=0 is not supported"),
])
def test_moe_options_megatron_cannot_reproduce_are_refused(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_gpt_model(tiny_config(family, **overrides))  # before any process group is needed


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf_config(tmp_path)
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        SafetensorsReader(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a Megatron-Core torch_dist checkpoint"):
        read_checkpoint_info(tmp_path)
    save_file({"a": torch.zeros(2)}, tmp_path / "model-00001-of-00002.safetensors")
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    reader = SafetensorsReader(tmp_path)
    assert torch.equal(reader.get("a"), torch.zeros(2))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        reader.get("b")
    with pytest.raises(KeyError, match="'c' is missing"):
        reader.get("c")


@pytest.fixture
def earlier_output(tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("earlier work")
    return out


@pytest.mark.slow
def test_tool_refuses_to_overwrite_without_force(tmp_path, earlier_output):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf_to_mcore.py"), "--hf", str(tmp_path),
                           "--out", str(earlier_output)], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "is not empty; pass --force" in done.stderr and "Traceback" not in done.stderr
    assert (earlier_output / "keep.txt").read_text() == "earlier work"


def test_export_refuses_to_overwrite_without_force(tmp_path, earlier_output):
    with pytest.raises(FileExistsError, match="is not empty; pass --force"):
        convert_mcore_to_hf(tmp_path, earlier_output, tmp_path)
    assert (earlier_output / "keep.txt").read_text() == "earlier work"
