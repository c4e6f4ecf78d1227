"""tools/plan_memory.py: parameter count and memory per GPU against a measured CPU run of the tiny model.

The measurement is a real Megatron-Core run on CPU: the tiny model built by the foundation builder, wrapped in
Megatron DDP with the trainer's distributed Adam, one forward/backward/step on a micro-batch. It sums the unique
storages of the weights, the fp32 main gradients, the optimizer state and every tensor autograd saved for backward
(weights excluded) - what would sit in GPU memory, with each core attention. Weights, gradients and optimizer state
must match exactly, the activations within 5%.
"""
import json
import sys
from pathlib import Path

import pytest

from megatron_cpo.models.families import FAMILIES
from tests.multiprocess import run_processes

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

from plan_memory import Batch, Layout, ModelShape, main, step_time, trainer_memory  # noqa: E402

MICRO_BATCH, SEQUENCE = 4, 64


def _unique_bytes(tensors) -> dict[int, int]:
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def measure_tiny_run(rank: int, world_size: int, model_dir: str, attention_backend: str) -> dict[str, int]:
    import torch

    from megatron_cpo import platform
    from megatron_cpo.models.builder import build_gpt_model, load_hf_config
    from megatron_cpo.trainer.config import ActorConfig
    from megatron_cpo.trainer.workers.optimizer import build_optimizer, wrap_ddp

    platform.init_distributed(1, 1)
    model = build_gpt_model(load_hf_config(model_dir), params_dtype=torch.float32, attention_backend=attention_backend)
    ddp = wrap_ddp(model, use_distributed_optimizer=True)
    optimizer, _ = build_optimizer(ddp, ActorConfig(), total_updates=10)
    weights = _unique_bytes(model.parameters())
    ids = torch.randint(0, 128, (MICRO_BATCH, SEQUENCE))
    positions = torch.arange(SEQUENCE).expand(MICRO_BATCH, SEQUENCE)
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = ddp(ids, positions, None)
        loss = logits.float().log_softmax(-1).gather(-1, ids[..., None]).mean()
    loss.backward()
    optimizer.step()
    states = [v for state in optimizer.optimizer.state.values() for v in state.values()
              if torch.is_tensor(v) and v.dim() > 0]
    platform.destroy_distributed()
    return {"weights": sum(weights.values()), "gradients": sum(_unique_bytes(p.main_grad for p in model.parameters())
                                                                .values()),
            "optimizer": sum(_unique_bytes(states).values()), "activations": sum(saved.values()),
            "params": sum(p.numel() for p in model.parameters())}


def measure_both_attentions(rank: int, world_size: int, model_dir: str) -> dict[str, dict[str, int]]:
    return {backend: measure_tiny_run(rank, world_size, model_dir, backend) for backend in ("local", "auto")}


@pytest.fixture(scope="module")
def tiny_dir(tiny_model_dir):
    return tiny_model_dir  # the suite's tiny model (tests/conftest.py)


def test_memory_figure_matches_a_measured_cpu_run_of_the_tiny_model(tiny_dir):
    """Both attentions (the local one's saved scores, torch's fused one without them): the planned activations within
    5% of the tensors autograd saved, and the planned saving of the fused attention within 5% of the measured one."""
    measured = run_processes(measure_both_attentions, 1, str(tiny_dir))[0]
    shape = ModelShape.from_hf_config(json.loads((tiny_dir / "config.json").read_text()))
    batch = Batch(micro_batch=MICRO_BATCH, prompt_length=SEQUENCE // 2, response_length=SEQUENCE // 2)
    planned = {backend: trainer_memory(shape, Layout(params_dtype="float32", reference_model=False,
                                                     fused_attention=backend != "local"), batch)
               for backend in measured}
    for backend, plan in planned.items():
        run = measured[backend]
        assert shape.total_params() == run["params"]
        assert plan["weights"] == run["weights"] and plan["gradients"] == run["gradients"]
        assert plan["optimizer"] == run["optimizer"]
        activations = sum(v for k, v in plan.items() if k.startswith("activations/"))
        assert abs(activations - run["activations"]) / run["activations"] < 0.05, (backend, plan, run)
        print(f"{backend}: activations planned {activations / 2**20:.3f} MiB, measured "
              f"{run['activations'] / 2**20:.3f} MiB")
    assert "activations/attention_scores" not in planned["auto"]
    planned_saving = planned["local"]["total"] - planned["auto"]["total"]
    measured_saving = measured["local"]["activations"] - measured["auto"]["activations"]
    assert measured_saving > 0 and abs(planned_saving - measured_saving) / measured_saving < 0.05


def test_qwen_7b_layout_follows_the_sharding_rules():
    shape = ModelShape(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       intermediate_size=18944, tied_embeddings=False, qkv_bias=True)
    assert abs(shape.total_params() - 7.62e9) / 7.62e9 < 0.01  # Qwen2.5-7B's published 7.62 B
    base = dict(tp=4, pp=1, world_size=16, params_dtype="bfloat16")
    sharded = trainer_memory(shape, Layout(**base), Batch(micro_batch=4, prompt_length=1024, response_length=3072))
    replicated = trainer_memory(shape, Layout(**base, distributed_optimizer=False), Batch())
    assert sharded["optimizer"] * 4 == pytest.approx(replicated["optimizer"])  # DP = 16 / 4
    assert sharded["weights"] * 2 == pytest.approx(sharded["gradients"])  # bf16 weights, fp32 grads
    times = step_time(shape, Layout(**base, engines=8, rollout_tp=2), Batch(train_batch_size=1024, n=8),
                      "h100-sxm", mfu=0.3)
    assert times["total"] == pytest.approx(sum(v for k, v in times.items() if k != "total"))
    with pytest.raises(ValueError, match="not a multiple of TP x PP"):
        Layout(tp=3, world_size=16).dp  # noqa: B018 (reading the property is what raises)


def test_cli_reads_a_recipe_and_reports(tiny_dir, capsys):
    recipe = ROOT / "examples" / "qwen2.5-math-1.5b" / "cpo.yaml"
    assert main(["--recipe", str(recipe), "--model", str(tiny_dir), "--trainer-gpus", "8", "--gpu", "h100-sxm"]) == 0
    out = capsys.readouterr().out
    assert "TP=1 PP=1 DP=8" in out and "time/generation" in out and "activations/logits" in out
    assert main(["--model", str(tiny_dir / "missing")]) == 2


def test_a_recipe_keeps_the_reference_by_the_trainers_rule(tiny_dir, capsys, tmp_path):
    """The trainer builds a reference for the KL loss, KL in the reward or verl's reference sync
    (`Config.needs_reference_model`); the plan counts its memory by the same rule, through the same `Layout`."""
    reports = {}
    for name, ref in (("plain", "false"), ("sync", "true")):
        recipe = tmp_path / f"{name}.yaml"
        recipe.write_text(f"actor_rollout_ref: {{actor: {{use_kl_loss: false}}, ref: {{sync_ref_model: {ref}}}}}\n")
        assert main(["--recipe", str(recipe), "--model", str(tiny_dir), "--json"]) == 0
        reports[name] = json.loads(capsys.readouterr().out)
    assert not reports["plain"]["layout"]["reference_model"] and reports["plain"]["memory_gib"]["reference"] == 0
    assert reports["sync"]["layout"]["reference_model"] and reports["sync"]["memory_gib"]["reference"] > 0


def test_colocated_plan_is_the_peak_of_the_two_phases_with_offload_honoured():
    from plan_memory import colocated_memory

    # GiB by hand: trainer 10 weights + 20 grads + 30 optimizer + 5 reference + 10 activations = 75;
    # engine 4 weights + 12 KV cache + 1 overhead = 17 awake, 1 asleep
    trainer = {"weights": 10, "gradients": 20, "optimizer": 30, "reference": 5, "activations/layers": 7,
               "activations/logits": 3, "total": 75}
    plan = colocated_memory(trainer, engine_weights=4, kv_cache=12, offload={"param", "optimizer"}, sleep_level=1,
                            engine_overhead=1)
    assert plan["training"] == 75 + 1  # engines asleep keep their overhead only
    assert plan["rollout"] == 17 + 20 + 5  # grads and reference stay, no activations
    assert plan["peak"] == 76 and plan["peak"] < plan["training"] + plan["rollout"]
    assert (plan["host/actor_offloaded"], plan["host/engine_weights"]) == (40, 4)
    everything = colocated_memory(trainer, 4, 12, {"param", "grad", "optimizer"}, sleep_level=2, engine_overhead=1)
    assert everything["rollout"] == 17 + 5 and everything["host/engine_weights"] == 0  # level 2 discards weights
    awake = colocated_memory(trainer, 4, 12, set(), sleep_level=0, engine_overhead=1)  # never sleeps, no offload
    assert awake["training"] == 75 + 17 and awake["rollout"] == 17 + 65 and awake["peak"] == 92
    with pytest.raises(ValueError, match=r"--offload \['params'\] unknown"):
        colocated_memory(trainer, 4, 12, {"params"}, sleep_level=1)


def test_cli_plans_a_colocated_recipe_with_its_offload_switches(tiny_dir, capsys, tmp_path):
    shipped = (ROOT / "examples" / "qwen2.5-math-1.5b" / "cpo.yaml").read_text()
    recipe = tmp_path / "colocated.yaml"  # the shipped recipe with verl's three offload switches on
    recipe.write_text(shipped.replace("      params_dtype: bfloat16\n", "      params_dtype: bfloat16\n"
                                      "      param_offload: true\n      grad_offload: true\n"
                                      "      optimizer_offload: true\n"))
    args = ["--model", str(tiny_dir), "--trainer-gpus", "8", "--colocate", "--kv-cache-gib", "2", "--json"]
    assert main(["--recipe", str(ROOT / "examples" / "qwen2.5-math-1.5b" / "cpo.yaml"), *args]) == 0
    plain = json.loads(capsys.readouterr().out)["colocated_gib"]
    assert main(["--recipe", str(recipe), *args]) == 0
    offloaded = json.loads(capsys.readouterr().out)
    memory, colocated = offloaded["memory_gib"], offloaded["colocated_gib"]
    assert colocated["rollout/trainer_kept"] == pytest.approx(memory["reference"])
    assert plain["rollout/trainer_kept"] == pytest.approx(
        memory["weights"] + memory["gradients"] + memory["optimizer"] + memory["reference"])
    assert colocated["peak"] == pytest.approx(max(colocated["training"], colocated["rollout"]))
    assert main(["--model", str(tiny_dir), "--colocate"]) == 2  # no KV cache size: a clear error
    assert "--kv-cache-gib or --gpu" in capsys.readouterr().err


def test_scale_settings_change_memory_and_time_as_derived():
    shape = ModelShape(vocab_size=152064, hidden_size=3584, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                       intermediate_size=18944, tied_embeddings=False, qkv_bias=True)
    batch = Batch(train_batch_size=1024, n=8, prompt_length=1024, response_length=3072, micro_batch=4,
                  extra_forwards=3, token_budget=16384, mean_response_length=1024)
    base = dict(tp=4, world_size=16, engines=8, rollout_tp=2)
    plain = step_time(shape, Layout(**base), batch, "h100-sxm", mfu=0.3)
    # one forward-only pass is a third of forward + backward; the recompute adds a forward to training
    assert plain["log_prob_forwards"] / batch.extra_forwards == pytest.approx(plain["training"] / 3)
    recompute = step_time(shape, Layout(**base, recompute="full"), batch, "h100-sxm", mfu=0.3)
    assert recompute["training"] == pytest.approx(plain["training"] * 4 / 3)
    packed = step_time(shape, Layout(**base, remove_padding=True), batch, "h100-sxm", mfu=0.3)
    assert packed["training"] < plain["training"] * (1024 + 1024) / (1024 + 3072) * 1.01  # real tokens only
    memory = {name: trainer_memory(shape, Layout(**base, **flags), batch) for name, flags in {
        "plain": {}, "fused": {"fused_kernels": True}, "sp": {"sequence_parallel": True},
        "recompute": {"recompute": "full"}}.items()}
    assert memory["fused"]["activations/logits"] < memory["plain"]["activations/logits"] / 1000
    assert memory["sp"]["activations/layers"] < memory["plain"]["activations/layers"]
    assert memory["recompute"]["activations/layers"] < memory["plain"]["activations/layers"] / 4


QWEN3_30B_A3B = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
                 "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                 "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False}
# The shipped recipes' models (their config.json on the Hub) and the trainer GPUs their headers give.
RECIPE_MODELS = {
    "qwen2.5-math-1.5b": (8, dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, num_hidden_layers=28,
                                  num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960,
                                  tie_word_embeddings=True)),
    "qwen2.5-math-7b": (16, dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                                 num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                                 tie_word_embeddings=False)),
    "qwen3-8b": (8, dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, num_hidden_layers=36,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                         tie_word_embeddings=False)),
    "qwen3-30b-a3b": (16, QWEN3_30B_A3B),
}


@pytest.mark.parametrize("folder", sorted(RECIPE_MODELS))
def test_recipes_turn_on_the_scale_settings_and_fit(folder, tmp_path, capsys):
    from megatron_cpo.config import load_config

    gpus, hf_config = RECIPE_MODELS[folder]
    recipe = ROOT / "examples" / folder / "cpo.yaml"  # CPO: the reference and the hinted pass, the largest plan
    config = load_config(recipe)
    model, actor = config.actor_rollout_ref.model, config.actor_rollout_ref.actor
    assert model.use_remove_padding and model.use_fused_kernels and actor.use_dynamic_bsz
    assert model.enable_gradient_checkpointing == (folder != "qwen2.5-math-1.5b")
    assert actor.megatron.sequence_parallel == (actor.megatron.tensor_model_parallel_size > 1)
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    assert main(["--recipe", str(recipe), "--model", str(tmp_path), "--trainer-gpus", str(gpus), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["layout"]["remove_padding"] and report["layout"]["fused_kernels"]
    assert report["memory_gib"]["total"] < 0.8 * 80  # an 80 GiB GPU with room to spare
    if folder == "qwen3-30b-a3b":  # 16 of the 128 experts per GPU, their optimizer state sharded over expert-DP 2
        assert (report["layout"]["ep"], report["layout"]["etp"], report["dp"]) == (8, 1, 4)
        assert report["params"] > 30e9 and report["active_params"] < 3.4e9


@pytest.mark.parametrize("family", list(FAMILIES))
def test_parameter_count_of_every_family_equals_transformers(family):
    from transformers import AutoModelForCausalLM

    from megatron_cpo.models.tiny import tiny_config

    overrides = {"attention_bias": True, "mlp_bias": True} if family == "llama" else {}
    config = tiny_config(family, **overrides)
    shape = ModelShape.from_hf_config(config.to_dict())
    model = AutoModelForCausalLM.from_config(config)
    assert shape.total_params() == sum(p.numel() for p in model.parameters())
    if shape.is_moe:  # every MoE layer of the tiny models has 4 experts and routes to 2
        assert shape.total_params() - shape.active_params() == shape.moe_layers * 2 * shape.expert_params()
    else:
        assert shape.active_params() == shape.total_params()


def test_moe_counts_total_and_active_parameters_and_shards_experts_over_ep():
    shape = ModelShape.from_hf_config(QWEN3_30B_A3B)
    assert abs(shape.total_params() - 30.5e9) / 30.5e9 < 0.01  # Qwen3-30B-A3B's published 30.5 B, 3.3 B active
    assert abs(shape.active_params() - 3.3e9) / 3.3e9 < 0.02
    base = dict(tp=4, world_size=16, sequence_parallel=True)
    ep1, ep8 = (trainer_memory(shape, Layout(**base, ep=ep, etp=1), Batch()) for ep in (1, 8))
    experts = 48 * 128 * shape.expert_params()  # bf16 weights: 2 bytes each, all on one rank at EP=1 (ETP=1)
    assert ep1["weights"] - ep8["weights"] == pytest.approx(experts * 2 * 7 / 8)
    # the experts' Adam state is sharded over the expert-data-parallel ranks: 16 / (EP 8 x ETP 1) = 2
    assert Layout(**base, ep=8, etp=1).expert_dp == 2
    times = step_time(shape, Layout(**base, ep=8, etp=1, engines=2, rollout_tp=4), Batch(), "h100-sxm", mfu=0.3)
    dense_equivalent = step_time(ModelShape(**{**shape.__dict__, "top_k": 128}), Layout(**base, ep=8, etp=1,
                                 engines=2, rollout_tp=4), Batch(), "h100-sxm", mfu=0.3)
    assert times["training"] < dense_equivalent["training"] / 5  # FLOPs follow the active parameters
    with pytest.raises(ValueError, match=r"not a multiple of PP x EP x ETP = 32"):
        Layout(tp=4, world_size=16, ep=8, etp=4).expert_dp  # noqa: B018 (reading the property is what raises)


def test_sequence_lengths_plan_the_trainers_micro_batches_and_the_attention_they_run():
    """`--sequence-lengths`: the micro-batches the trainer cuts (fixed rows padded to the batch's longest, token
    budgets of padded rows, packed THD rows) set the activations and the FLOPs; the local attention adds its scores."""
    from plan_memory import MicroBatch, micro_batch_flops, micro_batches

    shape = ModelShape(vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, head_dim=128,
                       intermediate_size=8960, tied_embeddings=True, qkv_bias=True)
    lengths = [300, 2000, 150, 700, 90, 1200, 400, 60]
    batch = Batch(micro_batch=2, token_budget=2400, sequence_lengths=lengths)
    layouts = {"fixed": {}, "budget": {"dynamic_bsz": True}, "packed": {"dynamic_bsz": True, "remove_padding": True},
               "packed_local": {"dynamic_bsz": True, "remove_padding": True, "fused_attention": False}}
    layouts = {name: Layout(world_size=1, params_dtype="bfloat16", reference_model=False, **flags)
               for name, flags in layouts.items()}
    cuts = {name: micro_batches(lengths, layout, batch)[0] for name, layout in layouts.items()}
    assert [(m.rows, m.width) for m in cuts["fixed"]] == [(2, 2000)] * 4  # padded to the batch's longest
    for name in ("budget", "packed", "packed_local"):  # every sequence once, in budgets of the trainer's tokens
        assert sorted(n for m in cuts[name] for n in m.lengths) == sorted(lengths)
    assert all(m.rows * m.width <= 2400 or m.rows == 1 for m in cuts["budget"])
    assert all(m.per_sequence and m.rows == 1 and m.width == sum(m.lengths) for m in cuts["packed"])
    assert not any(m.per_sequence for m in cuts["packed_local"])
    # FLOPs by hand: 2 x params per position + causal attention per row, or per sequence when packed
    micro = MicroBatch(1, 30, (10, 20), per_sequence=True)
    assert micro_batch_flops(shape, micro) == pytest.approx(
        2 * shape.active_params() * 30 + 2 * 28 * 12 * 128 * (10**2 + 20**2))
    memory = {name: trainer_memory(shape, layout, batch) for name, layout in layouts.items()}
    activations = {name: sum(v for k, v in plan.items() if k.startswith("activations/"))
                   for name, plan in memory.items()}
    assert activations["packed"] < activations["budget"] < activations["fixed"]
    assert "activations/attention_scores" in memory["packed_local"]
    assert activations["packed_local"] > activations["packed"]
    times = {name: step_time(shape, layout, batch, "h200", mfu=0.3)["training"] for name, layout in layouts.items()}
    assert times["packed"] < times["budget"] < times["fixed"]
