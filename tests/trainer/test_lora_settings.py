"""LoRA's settings: verl's Megatron keys and its FSDP spellings load, verl's Megatron LoRA launch script passes
`megatron-cpo train --dry-run`, and every bad input is refused before anything starts with one line naming the value
and the fix (a rank of 0 or below, a target that matches nothing, half of a fused layer, an adapter saved for another
base or rank, options LoRA does not combine with). No Megatron process group: configs, HF configs and files only."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_cpo.config import ConfigError, build_config, load_config, resolve_config
from megatron_cpo.models.builder import load_hf_config
from megatron_cpo.models.config import LoraConfig
from megatron_cpo.models.lora.peft_format import adapter_problems, peft_key
from megatron_cpo.models.lora.targets import adaptable_layers, layout_problems, select_layers
from tests.trainer.test_verl_compat import ROOT, overrides_of

TINY = ROOT / "examples" / "tiny" / "model"  # qwen2: 2 layers, hidden 128, 4 heads, 2 KV heads, ffn 256
LORA_SCRIPT = "lora_qwen3_30b_a3b_megatron.txt"


def lora(**settings) -> LoraConfig:
    return LoraConfig(**{"rank": 4, **settings})


def test_verls_megatron_keys_and_fsdp_spellings_load():
    megatron = build_config({}, ["actor_rollout_ref.model.lora.rank=32", "actor_rollout_ref.model.lora.alpha=64",
                                 "actor_rollout_ref.model.lora.lora_A_init_method=kaiming",
                                 "actor_rollout_ref.model.lora.type=lora",
                                 "actor_rollout_ref.model.lora.lora_B_init_method=zero",
                                 "critic.model.lora.rank=8"]).actor_rollout_ref.model.lora
    assert (megatron.rank, megatron.alpha, megatron.lora_A_init_method, megatron.scale) == (32, 64.0, "kaiming", 2.0)
    fsdp = build_config({}, ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=16",
                             "actor_rollout_ref.model.target_modules=all-linear",
                             "actor_rollout_ref.model.exclude_modules=null",
                             "actor_rollout_ref.model.lora_adapter_path=/some/adapter"])
    loaded = fsdp.actor_rollout_ref.model.lora
    assert (loaded.rank, loaded.alpha, loaded.target_modules, loaded.exclude_modules, loaded.adapter_path) == (
        16, 16.0, ["all-linear"], [], "/some/adapter")
    assert LoraConfig().enabled is False  # rank 0: off, verl's default


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.model.lora.rank=-1", "actor_rollout_ref.model.lora.rank=-1 must be an integer > 0"),
    ("critic.model.lora.alpha=0", "critic.model.lora.alpha=0.0 must be > 0"),
    ("actor_rollout_ref.model.lora.merge=false", "set merge=true"),
    ("actor_rollout_ref.model.lora.type=dora", "canonical_lora, vlm_lora and dora are not"),
    ("actor_rollout_ref.model.lora.lora_B_init_method=kaiming", "B starts at zero"),
    ("actor_rollout_ref.model.lora.lora_A_init_method=gaussian", "choose one of 'xavier', 'kaiming'"),
    ("actor_rollout_ref.model.lora.dropout_position=middle", "choose one of 'pre', 'post'"),
])
def test_bad_settings_are_refused_naming_the_value(override, expected):
    with pytest.raises(ConfigError, match=re.escape(expected)):
        build_config({}, [override])


def test_lora_does_not_combine_with_a_reference_copy_to_sync():
    with pytest.raises(ConfigError, match="with LoRA .* the reference is the base model with the adapters off"):
        build_config({}, ["actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.ref.sync_ref_model=true",
                          "actor_rollout_ref.actor.use_kl_loss=true"])


def test_targets_resolve_megatron_and_hf_names_patterns_and_exclusions():
    layers = adaptable_layers(load_hf_config(TINY))
    assert [layer.canonical for layer in layers[:4]] == [f"decoder.layers.0.{name}" for name in (
        "self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")]
    assert layers[0].hf_modules == tuple(f"model.layers.0.self_attn.{p}_proj" for p in "qkv")

    def picked(**settings):
        return [layer.canonical for layer in select_layers(layers, lora(**settings))]

    assert len(picked()) == len(picked(target_modules=["all-linear"])) == 8
    assert picked(target_modules=["q_proj", "k_proj", "v_proj", "down_proj"]) == picked(
        target_modules=["linear_qkv", "linear_fc2"])
    assert picked(target_modules=["*.layers.1.*"]) == [layer.canonical for layer in layers[4:]]
    assert picked(exclude_modules=["model.layers.0.*", "linear_proj"]) == [
        "decoder.layers.1.self_attention.linear_qkv", "decoder.layers.1.mlp.linear_fc1",
        "decoder.layers.1.mlp.linear_fc2"]


@pytest.mark.parametrize("settings, expected", [
    ({"target_modules": ["linear_qvk"]}, "target_modules entry 'linear_qvk' matches no layer; the model has "
                                         "linear_qkv, linear_proj, linear_fc1, linear_fc2 (Hugging Face: q_proj, "
                                         "k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)"),
    ({"target_modules": ["q_proj", "v_proj"]}, "names q_proj, v_proj without k_proj: Megatron's fused linear_qkv"),
    ({"exclude_modules": ["up_proj"]}, "exclude_modules entry 'up_proj' names part of Megatron's fused linear_fc1"),
    ({"exclude_modules": ["*.layers.7.*"]}, "exclude_modules entry '*.layers.7.*' matches no targeted layer"),
    ({"target_modules": ["linear_proj"], "exclude_modules": ["o_proj"]}, "removes every layer"),
])
def test_targets_that_select_nothing_or_half_a_fused_layer_are_refused(settings, expected):
    with pytest.raises(ValueError, match=re.escape(expected)):
        select_layers(adaptable_layers(load_hf_config(TINY)), lora(**settings))


def test_the_layout_must_split_the_rank_and_leave_no_stage_without_adapters():
    hf_config = load_hf_config(TINY)
    assert layout_problems(hf_config, lora(rank=4), tp=2, pp=2, etp=2) == []
    [odd] = layout_problems(hf_config, lora(rank=3), tp=2, pp=1, etp=2)
    assert odd.startswith("actor_rollout_ref.model.lora.rank=3 does not split over tensor-parallel size 2")
    [empty] = layout_problems(hf_config, lora(target_modules=["*.layers.0.*"]), tp=1, pp=2, etp=1)
    assert "leave pipeline stage(s) [1] of pipeline_model_parallel_size=2 without an adapter" in empty


def _adapter(path: Path, rank: int = 4, alpha: float = 8.0, shapes: dict | None = None,
             drop: str | None = None) -> Path:
    """A PEFT adapter directory for the tiny model's attention and MLP (its real shapes unless `shapes` says)."""
    path.mkdir(parents=True)
    widths = {"q_proj": (128, 128), "k_proj": (64, 128), "v_proj": (64, 128), "o_proj": (128, 128),
              "gate_proj": (256, 128), "up_proj": (256, 128), "down_proj": (128, 256)}
    widths.update(shapes or {})
    tensors = {}
    for layer in range(2):
        for name, (out, width) in widths.items():
            group = "self_attn" if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            module = f"model.layers.{layer}.{group}.{name}"
            tensors[peft_key(module, "A")] = torch.zeros(rank, width)
            tensors[peft_key(module, "B")] = torch.zeros(out, rank)
    tensors.pop(drop, None)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
                                                          "target_modules": sorted(widths)}))
    return path


def test_a_starting_adapter_of_this_base_and_rank_is_accepted(tmp_path):
    assert adapter_problems(_adapter(tmp_path / "a"), TINY, load_hf_config(TINY), lora(alpha=8)) == []


@pytest.mark.parametrize("kind, expected", [
    ("rank", "was saved with r=8, lora_alpha=8.0, and this run has actor_rollout_ref.model.lora.rank=4, alpha=8.0; "
             "set them to the adapter's"),
    ("base", "was saved for another base model than"),
    ("targets", "does not hold the adapters actor_rollout_ref.model.lora.target_modules / exclude_modules select: "
                "it lacks ['base_model.model.model.layers.1.mlp.down_proj.lora_A.weight']"),
    ("folder", "is not a PEFT adapter directory"),
    ("dora", "only plain LoRA adapters"),
])
def test_a_starting_adapter_of_another_base_rank_or_targets_is_refused(tmp_path, kind, expected):
    path = tmp_path / kind
    if kind == "rank":
        _adapter(path, rank=8)
    elif kind == "base":
        _adapter(path, shapes={"q_proj": (256, 256)})
    elif kind == "targets":
        _adapter(path, drop=peft_key("model.layers.1.mlp.down_proj", "A"))
    elif kind == "folder":
        path.mkdir()
    else:
        _adapter(path)
        config = json.loads((path / "adapter_config.json").read_text())
        (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    [problem] = adapter_problems(path, TINY, load_hf_config(TINY), lora(alpha=8))
    assert problem.startswith(f"actor_rollout_ref.model.lora.adapter_path={str(path)!r}")
    assert expected in problem


def test_preflight_reports_lora_problems_before_anything_starts(tmp_path):
    from megatron_cpo.trainer.run.preflight import preflight
    from tests.trainer.test_preflight import _row, write_rows

    data = write_rows(tmp_path / "train.parquet", [_row(), _row(truth="5")])
    base = [f"actor_rollout_ref.model.path={TINY}", f"data.train_files={data}", f"data.val_files={data}",
            f"trainer.default_local_dir={tmp_path / 'run'}"]
    plan = preflight(load_config(None, [*base, "actor_rollout_ref.model.lora.rank=8",
                                        "actor_rollout_ref.actor.use_kl_loss=true"]), planning=True)
    assert "LoRA rank 8: only the adapters train, the reference is the base with them off" in plan.describe()
    assert plan.layout.reference_model is False and plan.layout.lora_rank == 8
    with pytest.raises(ConfigError, match="target_modules entry 'qkv' matches no layer") as err:
        preflight(load_config(None, [*base, "actor_rollout_ref.model.lora.rank=8",
                                     "actor_rollout_ref.model.lora.target_modules=[qkv]"]), planning=True)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="is not a PEFT adapter directory"):
        preflight(load_config(None, [*base, "actor_rollout_ref.model.lora.rank=8",
                                     f"actor_rollout_ref.model.lora.adapter_path={tmp_path}"]), planning=True)


def test_verls_megatron_lora_script_loads_with_its_lora_settings():
    resolved = resolve_config(ROOT / "examples" / "qwen3-30b-a3b" / "grpo.yaml", overrides_of(LORA_SCRIPT))
    config = resolved.config
    loaded = config.actor_rollout_ref.model.lora
    assert (loaded.rank, loaded.alpha, loaded.lora_A_init_method) == (32, 64.0, "kaiming")
    assert {"actor_rollout_ref.actor.megatron.use_mbridge", "actor_rollout_ref.actor.megatron.vanilla_mbridge",
            "model_engine"} <= set(resolved.ignored)
    assert config.actor_rollout_ref.actor.use_kl_loss and config.needs_reference_model


def test_verls_megatron_lora_script_passes_the_dry_run(tmp_path, capsys, monkeypatch):
    """The script as it is but for the paths (the data: this test's rows; the model: a stand-in folder with
    Qwen3-30B-A3B's heads, layers and experts and tiny weights) and the logger (wandb is not installed here), on its
    1 node x 8 GPUs at TP 2 x PP 2, EP 4."""
    from megatron_cpo.cli import main
    from megatron_cpo.models.tiny import write_tiny_model
    from tests.tools.test_plan_memory import QWEN3_30B_A3B
    from tests.trainer.test_preflight import _row, write_rows

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = write_tiny_model(tmp_path / "model", family="qwen3_moe", seed=0)
    hf = json.loads((model / "config.json").read_text())
    hf.pop("layer_types", None)
    hf.update(QWEN3_30B_A3B)
    (model / "config.json").write_text(json.dumps(hf))
    data = write_rows(tmp_path / "train.parquet", [_row(), _row(truth="5")])
    main(["train", "--config", str(ROOT / "examples" / "qwen3-30b-a3b" / "grpo.yaml"), "--dry-run",
          *overrides_of(LORA_SCRIPT), f"data.train_files={data}", f"data.val_files={data}",
          f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={tmp_path / 'run'}",
          "trainer.logger=[console]"])
    out = capsys.readouterr().out
    assert "nothing was started" in out and "# trainer: 8 process(es)" in out and "TP 2 x PP 2 x DP 2" in out
    assert "EP 4 x ETP 1" in out and "LoRA rank 32: only the adapters train" in out
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"
    shutil.rmtree(model)


def test_the_adapter_of_a_fused_layernorm_linear_reads_the_normalised_input():
    """Transformer Engine's LayerNormColumnParallelLinear cannot exist here (no GPU build): a stand-in with its
    attributes (`layer_norm_weight`, `config`) gets the RMSNorm the layer applies before its matrix (torch's)."""
    from types import SimpleNamespace

    from megatron_cpo.models.lora.layers import _rms_normed

    x = torch.randn(5, 2, 16, generator=torch.Generator().manual_seed(0))
    weight = torch.rand(16, generator=torch.Generator().manual_seed(1)) + 0.5
    layer = SimpleNamespace(layer_norm_weight=weight,
                            config=SimpleNamespace(layernorm_zero_centered_gamma=False, layernorm_epsilon=1e-6))
    expected = torch.nn.functional.rms_norm(x, (16,), weight, eps=1e-6)
    assert torch.allclose(_rms_normed(layer, x), expected, atol=1e-6)
    layer.config.layernorm_zero_centered_gamma = True  # the weight stores gamma - 1
    assert torch.allclose(_rms_normed(layer, x), torch.nn.functional.rms_norm(x, (16,), weight + 1, eps=1e-6),
                          atol=1e-6)
