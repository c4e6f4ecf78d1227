"""HF options, odd vocabularies and foreign checkpoints (2 real gloo processes, real Megatron-Core, one spawned run).

options_worker.check_options_and_checkpoints does the work; the tests assert on its results:
- Llama `attention_bias` alone, `mlp_bias` alone, linear RoPE scaling and a Qwen2 sliding window (5 tokens on layer 1)
  give transformers' logits (<= 1e-5, fp32) at TP=2 and export back bit for bit; a bias the config does not declare
  is an error naming the tensor;
- a vocabulary of 101 (padded to 102 at TP=2) saved at TP=2 loads at TP=1 and PP=2 and converts back bit for bit,
  and saved at TP=1 loads at TP=2;
- a plain Megatron-Core checkpoint as Megatron-LM writes it (iteration directory, tracker file, pickled args, the
  vocabulary padded to 128 rows, no metadata of ours) loads at TP=1 and TP=2 and converts back bit for bit; one of
  another architecture is an error naming the tensors;
- a model whose config says bfloat16 is written in bfloat16 both ways by default.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from megatron_cpo.models.tiny import write_tiny_model
from tests.foundation.options_worker import BF16_MODEL, OPTION_MODELS, VOCAB_MODEL, check_options_and_checkpoints
from tests.multiprocess import run_processes

TOLERANCE = 1e-5
MODELS = {
    "llama_attention_bias": ("llama", {"attention_bias": True}),
    "llama_mlp_bias": ("llama", {"mlp_bias": True}),
    "llama_linear_rope": ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}}),
    "qwen2_sliding_window": ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
    VOCAB_MODEL: ("qwen2", {"vocab_size": 101}),
    BF16_MODEL: ("qwen2", {"dtype": torch.bfloat16}),
}


def _without_sliding_window(hf_dir: str):
    """The transformers model of `hf_dir` with its sliding window turned off (same weights)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = json.loads((Path(hf_dir) / "config.json").read_text())
    config = Qwen2Config(**{**config, "use_sliding_window": False, "layer_types": None})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.load_state_dict(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict())
    return model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    work = tmp_path_factory.mktemp("options")
    hf_dirs = {name: str(write_tiny_model(work / f"hf_{name}", family, seed=5, random_biases=True, **overrides))
               for name, (family, overrides) in MODELS.items()}
    undeclared = write_tiny_model(work / "hf_llama_bias_not_in_config", "llama", seed=5, random_biases=True,
                                  attention_bias=True)
    config = json.loads((undeclared / "config.json").read_text())
    (undeclared / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    hf_dirs["llama_bias_not_in_config"] = str(undeclared)
    input_ids = torch.randint(0, 100, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hf_logits = {name: AutoModelForCausalLM.from_pretrained(hf_dirs[name], dtype=torch.float32).eval()(
            input_ids).logits for name in MODELS}
        without_window = _without_sliding_window(hf_dirs["qwen2_sliding_window"])(input_ids).logits
    # the window masks something on these 19 tokens, so a model that ignored it would fail the logits test
    assert (without_window - hf_logits["qwen2_sliding_window"]).abs().max() > 0.01
    torch.save(hf_logits, work / "hf_logits.pt")
    return {"ranks": run_processes(check_options_and_checkpoints, 2, hf_dirs, str(work), input_ids),
            "hf_dirs": hf_dirs}


def _diffs(run, layout: str, case: str) -> list[float]:
    return [r[layout][case]["hf_diff"] for r in run["ranks"] if r[layout][case]["hf_diff"] is not None]


def _hf_tensors(hf_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(hf_dir.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


@pytest.mark.parametrize("case", OPTION_MODELS)
def test_honoured_options_give_transformers_logits(run, case):
    diffs = _diffs(run, "tp2", case)
    assert len(diffs) == 2 and max(diffs) <= TOLERANCE, f"{case}: max abs logit diff {max(diffs)}"
    exports = [r["tp2"][case]["export"] for r in run["ranks"]]
    assert exports[0]["all_equal"] and set(exports[0]["names"]) == set(load_file(
        Path(run["hf_dirs"][case]) / "model.safetensors"))
    bias_names = {n for n in exports[0]["names"] if n.endswith(".bias")}
    expected_biases = {"llama_attention_bias": {"q_proj", "k_proj", "v_proj", "o_proj"},
                       "llama_mlp_bias": {"gate_proj", "up_proj", "down_proj"}, "llama_linear_rope": set(),
                       "qwen2_sliding_window": {"q_proj", "k_proj", "v_proj"}}[case]
    assert {n.split(".")[-2] for n in bias_names} == expected_biases


def test_tensor_the_config_does_not_declare_is_an_error(run):
    message = run["ranks"][0]["tp2"]["left_over_error"]
    assert message is not None and "not used by the model" in message
    assert "model.layers.0.self_attn.o_proj.bias" in message and "model.layers.0.self_attn.q_proj.bias" in message


@pytest.mark.parametrize("layout, case", [("tp1", "vocab101_tp2_checkpoint"), ("pp2", "vocab101_tp2_checkpoint"),
                                          ("tp2_again", "vocab101_tp1_checkpoint"), ("tp1", "megatron_lm_checkpoint"),
                                          ("tp2_again", "megatron_lm_checkpoint"), ("tp1", "bf16_checkpoint")])
def test_checkpoints_load_at_another_layout(run, layout, case):
    diffs = _diffs(run, layout, case)
    assert diffs and max(diffs) <= TOLERANCE, f"{layout} {case}: {diffs}"


@pytest.mark.parametrize("case", ["vocab101_tp2_checkpoint", "megatron_lm_checkpoint"])
def test_odd_vocabulary_exports_bit_identical_at_tp1(run, case):
    exports = [r["tp1"][case]["export"] for r in run["ranks"]]
    original = load_file(Path(run["hf_dirs"][VOCAB_MODEL]) / "model.safetensors")
    assert original["model.embed_tokens.weight"].shape == original["lm_head.weight"].shape == (101, 128)
    assert all(e["all_equal"] for e in exports)
    assert set(exports[0]["names"]) == set(original) and exports[1]["names"] == []  # the first replica exports


@pytest.mark.parametrize("case, source", [("vocab101_round_trip", VOCAB_MODEL),
                                          ("megatron_lm_round_trip", VOCAB_MODEL), ("bf16_round_trip", BF16_MODEL)])
def test_round_trip_at_pp2_is_bit_identical(run, case, source):
    (out,) = {r["pp2"][case] for r in run["ranks"]}
    original, round_trip = _hf_tensors(Path(run["hf_dirs"][source])), _hf_tensors(Path(out))
    assert sorted(round_trip) == sorted(original)
    assert all(torch.equal(round_trip[n], original[n]) and round_trip[n].dtype == original[n].dtype for n in original)
    expected_dtype = torch.bfloat16 if source == BF16_MODEL else torch.float32
    assert {t.dtype for t in round_trip.values()} == {expected_dtype}


def test_bf16_config_is_saved_in_bf16_by_default(run):
    assert json.loads((Path(run["hf_dirs"][BF16_MODEL]) / "config.json").read_text())["dtype"] == "bfloat16"
    assert run["ranks"][0]["tp2"]["bf16_saved_dtypes"] == ["torch.bfloat16"]


def test_checkpoint_of_another_architecture_without_metadata_is_an_error(run):
    message = run["ranks"][0]["tp1"]["wrong_architecture_error"]
    assert message is not None and "does not match the model" in message
    assert message.count("decoder.layers.self_attention.linear_proj.bias is missing") == 1
    assert "tensors the model does not have: ['output_layer.weight']" in message  # the Llama model is tied
