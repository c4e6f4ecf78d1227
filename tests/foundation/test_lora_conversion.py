"""A training run's checkpoint converted to Hugging Face (`megatron-cpo convert-mcore-to-hf`,
tools/convert_mcore_to_hf.py), in this process on the tied tiny Qwen2:

- round trip: the actor started from a PEFT adapter of the real `peft` (HF base + adapter, its fused modules sharing
  one A) and checkpointed by the trainer (its rank file holds the adapters only) converts back to that adapter's
  tensors exactly, and to the run's own export; `PeftModel.from_pretrained` on the transformers base gives the
  Megatron actor's logits; `--merge` gives a model with those logits;
- a fully trained actor's checkpoint converts to the run's own export;
- bad input gets one line naming the fix.
TP=2, PP=2 and DP=2 checkpoints: tests/foundation/test_lora_layouts.py.
"""
import json
import os
import shutil

import pytest
import torch

from megatron_cpo.cli import build_parser, main
from megatron_cpo.models.lora.peft_format import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from tests.tools.test_merge_lora import peft_adapter

TOKENS = torch.tensor([[5, 9, 33, 40, 2, 7, 8, 11], [3, 14, 15, 92, 65, 35, 8, 9]])
RANK, ALPHA = 4, 8.0


def _checkpoint(root, model_dir, *overrides, perturb: bool = False):
    """The trainer's actor on `model_dir` (with `overrides`), checkpointed at step 1 with its Hugging Face export;
    returns the step directory and the actor's logits. `perturb`: the weights moved first, as training would."""
    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models import forward_logits
    from megatron_cpo.trainer.components import policies_for
    from megatron_cpo.trainer.run.checkpointing import CheckpointManager, hf_exporter

    config = build_config({}, [f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2",
                               "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                               *overrides])
    saved_environment = dict(os.environ)
    platform.init_distributed(1, 1, seed=1)
    try:
        actor, _ = policies_for(config, pad_token_id=0, total_updates=10)
        if perturb:
            generator = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for param in actor.model.parameters():
                    param.add_(torch.randn(param.shape, generator=generator) * 1e-2)
        step = CheckpointManager(root, actor, None, export_hf=hf_exporter(actor, str(model_dir), "float32")).save(1)
        return step, forward_logits(actor.model, TOKENS)
    finally:
        platform.destroy_distributed()
        os.environ.clear()
        os.environ.update(saved_environment)


def _convert(step, out, base, *flags):
    main(["convert-mcore-to-hf", "--mcore", str(step), "--out", str(out), "--hf-config", str(base), *flags])


def _load(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _assert_equal(got: dict, expected: dict):
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[name], expected[name]) for name in got), [
        name for name in got if not torch.equal(got[name], expected[name])][:3]


@pytest.fixture(scope="module")
def lora_run(tied_qwen2_dir, tmp_path_factory):
    """A LoRA actor started from a `peft` adapter, checkpointed, then converted to a PEFT directory and merged."""
    work = tmp_path_factory.mktemp("lora_conversion")
    peft_adapter(tied_qwen2_dir, work / "start", rank=RANK, alpha=ALPHA, share_fused_a=True)
    started = _load(work / "start" / ADAPTER_WEIGHTS)
    step, logits = _checkpoint(work / "run", tied_qwen2_dir, f"actor_rollout_ref.model.lora.rank={RANK}",
                               f"actor_rollout_ref.model.lora.alpha={ALPHA}",
                               f"actor_rollout_ref.model.lora.adapter_path={work / 'start'}")
    shutil.rmtree(work / "start")  # what follows reads the checkpoint, not the adapter the run started from
    _convert(work / "run", work / "adapter", tied_qwen2_dir)  # the checkpoints directory: the step `latest` names
    _convert(step, work / "merged", tied_qwen2_dir, "--merge")
    return {"started": started, "step": step, "logits": logits, "work": work, "base": tied_qwen2_dir}


def test_a_lora_checkpoint_converts_back_to_the_adapter_it_started_from(lora_run):
    adapter = lora_run["work"] / "adapter"
    converted = _load(adapter / ADAPTER_WEIGHTS)
    _assert_equal(converted, lora_run["started"])
    _assert_equal(converted, _load(lora_run["step"] / "huggingface" / ADAPTER_WEIGHTS))
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (RANK, ALPHA,
                                                                                      str(lora_run["base"]))
    assert sorted(config["target_modules"]) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                "v_proj"]
    assert not (lora_run["work"] / "adapter.partial").exists()


def test_the_converted_adapter_gives_the_actors_logits_in_peft_and_merged(lora_run):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.float32)
    with torch.no_grad():
        base_logits = base(TOKENS).logits
        adapted = PeftModel.from_pretrained(base, lora_run["work"] / "adapter")(TOKENS).logits
        merged = AutoModelForCausalLM.from_pretrained(lora_run["work"] / "merged", dtype=torch.float32)(TOKENS).logits
    expected = lora_run["logits"]
    assert float((adapted - expected).abs().max()) <= 1e-5
    assert float((merged - expected).abs().max()) <= 1e-5
    assert float((base_logits - expected).abs().max()) > 1e-3  # the adapters do change the model
    assert (lora_run["work"] / "merged" / "tokenizer.json").is_file()


@pytest.fixture(scope="module")
def full_run(tied_qwen2_dir, tmp_path_factory):
    work = tmp_path_factory.mktemp("full_conversion")
    step, _ = _checkpoint(work / "run", tied_qwen2_dir, perturb=True)
    return {"step": step, "work": work, "base": tied_qwen2_dir}


def test_a_fully_trained_actors_checkpoint_converts_to_the_runs_export(full_run):
    out = full_run["work"] / "hf"
    _convert(full_run["step"], out, full_run["base"])
    converted = _load(out / "model.safetensors")
    _assert_equal(converted, _load(full_run["step"] / "huggingface" / "model.safetensors"))
    base = _load(full_run["base"] / "model.safetensors")
    assert all(not torch.equal(converted[name], base[name]) for name in base)


def _run(*argv):
    from megatron_cpo.trainer.run.checkpoint_conversion import run_checkpoint_to_hf

    run_checkpoint_to_hf(build_parser().parse_args(["convert-mcore-to-hf", *argv]))


def test_bad_input_is_refused_naming_the_fix(lora_run, full_run, tmp_path, monkeypatch):
    from megatron_cpo.models.conversion_commands import convert_hf_to_mcore
    from megatron_cpo.models.tiny import write_tiny_model

    base, out = str(full_run["base"]), str(tmp_path / "out")
    with pytest.raises(ValueError, match="holds a fully trained actor, no LoRA adapters to merge; drop --merge"):
        _run("--mcore", str(full_run["step"]), "--out", out, "--hf-config", base, "--merge")
    with pytest.raises(ValueError, match="holds no LoRA adapters .* drop --merge"):
        _run("--mcore", str(tmp_path), "--out", out, "--hf-config", base, "--merge")
    with pytest.raises(ValueError, match="converts at that layout .* drop --tp 2"):
        _run("--mcore", str(lora_run["step"]), "--out", out, "--hf-config", base, "--tp", "2")
    other = write_tiny_model(tmp_path / "other", family="qwen2", seed=0, hidden_size=64, intermediate_size=128)
    with pytest.raises(ValueError, match="does not fit the model of --hf-config .* pass the base model the run"):
        _run("--mcore", str(lora_run["step"]), "--out", out, "--hf-config", str(other))
    old = tmp_path / "old_step"
    shutil.copytree(lora_run["step"], old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({k: v for k, v in manifest.items() if k != "actor"}))
    with pytest.raises(ValueError, match="does not record the actor's layout .* convert its huggingface/ export"):
        _run("--mcore", str(old), "--out", out, "--hf-config", base)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="written by 1 ranks .* torchrun --nproc-per-node 1"):
        _run("--mcore", str(lora_run["step"]), "--out", out, "--hf-config", base)
    with pytest.raises(FileNotFoundError, match=r"is a PEFT adapter, not a model: .*\.model\.lora\.adapter_path"):
        convert_hf_to_mcore(lora_run["work"] / "adapter", out)
