"""LoRA adapters split over TP (with and without sequence parallelism), PP, EP and expert-TP give what they give at
TP=1, on two real gloo ranks running Megatron-Core; one pair of processes runs every case in turn (the start-up is
paid once).

- the model (a tiny tied Qwen2 with qkv biases; a tiny Qwen3-MoE whose experts carry adapters too): with B = 0 it is
  the base exactly, with its adapters off it is the base exactly, and with adapters whose B is not zero its logits,
  loss and every adapter's gradients (exported whole under PEFT's names) equal TP=1's within 1e-5; the merged weights
  it exports, and its PEFT export, equal TP=1's;
- the trainer's actor with LoRA and a KL loss against the reference (the base with its adapters off): two updates at
  TP=2 and PP=2 log the losses, KL and gradient norm of TP=1; the base stays as loaded and only the adapters reach the
  optimizer; PPO's critic with LoRA trains its adapters and its value head only; the run's checkpoint converts, on the
  ranks that wrote it, to its own PEFT export (and merged, to merge-lora's model).
"""
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.multiprocess import run_processes

TOLERANCE = 1e-5
RANK, ALPHA, SEED = 4, 8.0, 7
TOKENS = torch.tensor([[5, 9, 33, 40, 2, 7, 8, 11], [3, 14, 15, 92, 65, 35, 8, 9]])
DENSE_LAYOUTS = {"tp1": (1, 1, 1, None, False), "tp2": (2, 1, 1, None, False), "tp2_sp": (2, 1, 1, None, True),
                 "pp2": (1, 2, 1, None, False)}
MOE_LAYOUTS = {"tp1": (1, 1, 1, None, False), "ep2": (1, 1, 2, None, False), "tp2_etp2_sp": (2, 1, 1, 2, True)}
UPDATE_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "kl")


def _gather_dicts(local: dict) -> dict:
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return {key: value for part in parts for key, value in part.items()}


def _set_b(model) -> None:
    """Every adapter's B: one [out, rank] matrix per Hugging Face module drawn from its name, put into the layer's
    Megatron layout at this TP size (q/k/v by KV group, gate/up per TP rank) as its weights are, this rank's rows
    kept."""
    from megatron_cpo.models.lora.apply import adapter_sites, layer_seed
    from megatron_cpo.models.weight_mapping import _expert_shape, _shape

    shape = _shape(model, model.hf_config)
    shapes = {False: shape, True: _expert_shape(shape)}
    for site in adapter_sites(model):
        adapter = getattr(site.entry.param, "lora_adapter", None)
        if adapter is None:
            continue
        mapping, layout = site.entry.mapping, shapes[site.expert]
        rows = [part.shape[0] for part in mapping.split(torch.empty(adapter.lora_B.shape[0] * adapter.size, RANK),
                                                        layout)]
        parts = [torch.randn(count, RANK, generator=torch.Generator().manual_seed(layer_seed(module, 1))) * 0.05
                 for module, count in zip(site.layer.hf_modules, rows)]
        full = mapping.merge(parts, layout)
        adapter.lora_B.data.copy_(full.chunk(adapter.size, dim=0)[adapter.rank_in_group])


def _peft_tensors(model, grads: bool) -> dict:
    """The adapters (or their gradients) under PEFT's names, whole, from every stage, on every rank."""
    from megatron_cpo.models.lora.layers import adapters_of
    from megatron_cpo.models.lora.peft_format import iter_peft_tensors

    saved = {}
    if grads:
        for adapter in adapters_of(model):
            for param in (adapter.lora_A, adapter.lora_B):
                saved[param] = param.data
                param.data = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
    try:
        return _gather_dicts({name: tensor.clone() for name, tensor in iter_peft_tensors(model)})
    finally:
        for param, data in saved.items():
            param.data = data


def _train_forward(model) -> tuple[torch.Tensor | None, float | None]:
    """One forward and backward through Megatron's schedule: cross-entropy of the next token over the real
    vocabulary; the logits and loss on the last stage (None elsewhere)."""
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = TOKENS
    positions = torch.arange(tokens.shape[1]).unsqueeze(0).expand_as(tokens)
    seen = {}

    def loss_fn(output):
        logits = tensor_parallel.gather_from_tensor_model_parallel_region(output)[..., :model.hf_vocab_size]
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))
        seen["logits"], seen["loss"] = logits.detach().float(), float(loss)
        return loss, {}

    def forward_step(data_iterator, stage_model):
        next(data_iterator)
        return stage_model(tokens, positions, attention_mask=None), loss_fn

    model.train()
    get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([tokens]), model=[model],
                                num_microbatches=1, seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0],
                                forward_only=False)
    last = parallel_state.is_pipeline_last_stage()
    return (seen["logits"], seen["loss"]) if last else (None, None)


def _model_case(model_dir: str, layout: tuple, work_dir: str, name: str) -> dict:
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.models import build_gpt_model, forward_logits, iter_hf_weights, load_hf_config, load_hf_weights
    from megatron_cpo.models.config import LoraConfig
    from megatron_cpo.models.lora.apply import apply_lora
    from megatron_cpo.models.lora.layers import adapters_disabled
    from megatron_cpo.models.lora.peft_format import load_peft_adapter, save_peft_adapter

    tp, pp, ep, etp, sp = layout
    platform.init_distributed(tp, pp, seed=1, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    model = build_gpt_model(load_hf_config(model_dir), sequence_parallel=sp)
    load_hf_weights(model, model_dir)
    base = forward_logits(model, TOKENS)
    apply_lora(model, LoraConfig(rank=RANK, alpha=ALPHA), seed=SEED)
    at_zero = forward_logits(model, TOKENS)
    _set_b(model)
    logits, loss = _train_forward(model)
    with adapters_disabled(model):
        off = forward_logits(model, TOKENS)
    model.eval()
    save_peft_adapter(model, Path(work_dir) / name, model_dir)
    # a fresh model at this layout, its adapters loaded from TP=1's export
    reloaded = build_gpt_model(load_hf_config(model_dir), sequence_parallel=sp)
    load_hf_weights(reloaded, model_dir)
    apply_lora(reloaded, LoraConfig(rank=RANK, alpha=ALPHA), seed=SEED + 1)
    load_peft_adapter(reloaded, Path(work_dir) / (name.split("/")[0] + "/tp1"))
    from_tp1 = forward_logits(reloaded, TOKENS)
    result = {"grads": _peft_tensors(model, grads=True), "peft": _peft_tensors(model, grads=False),
              "merged": _gather_dicts({name: t.clone() for name, t in iter_hf_weights(model, model.hf_config)}),
              "last": {}}
    if base is not None:
        result["last"] = {"logits": logits, "loss": loss, "b0_exact": torch.equal(at_zero, base),
                          "off_exact": torch.equal(off, base), "changed": float((logits - base).abs().max()),
                          "from_tp1": from_tp1}
    result["last"] = next(part for part in _all(result["last"]) if part)
    parallel_state.destroy_model_parallel()
    return result


def _all(value):
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value)
    return parts


def _two_updates(model_dir: str, tp: int, pp: int, work_dir: str) -> dict:
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models.weight_mapping import model_entries
    from megatron_cpo.trainer.batch.step_batch import StepBatch
    from megatron_cpo.trainer.components import policies_for, policy_update_config
    from megatron_cpo.trainer.workers.policy_update import compute_advantages, compute_log_probs, update_policy

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.use_kl_loss=true",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.model.lora.rank={RANK}", f"actor_rollout_ref.model.lora.alpha={ALPHA}"])
    platform.init_distributed(tp, pp, seed=1)
    actor, reference = policies_for(config, pad_token_id=0, total_updates=10)
    frozen = {entry.name: entry.param.detach().clone() for entry in model_entries(actor.model, actor.model.hf_config)}
    generator = torch.Generator().manual_seed(0)
    responses = [torch.randint(3, 90, (int(torch.randint(2, 10, (1,), generator=generator)),),
                               generator=generator).tolist() for _ in range(8)]
    scores = torch.tensor([1.0, 0, 0, 1, 0, 1, 1, 1])
    batch = StepBatch([[1, 5, 6, 7, 8]] * 4 + [[1, 9, 10, 11]] * 4, responses, [[-4.0] * len(r) for r in responses],
                      scores, scores, torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), torch.zeros(8, dtype=torch.bool), 1.0)
    history = []
    for _ in range(2):
        settings = policy_update_config(config)
        log_probs = compute_log_probs(batch, actor, reference, settings, pad_token_id=0)
        advantages, metrics = compute_advantages(batch, log_probs, settings)
        history.append({**metrics, **update_policy(actor, batch, log_probs, advantages, settings).metrics})
    run_dir = _checkpoint_and_convert(actor, model_dir, Path(work_dir) / f"run_{tp}x{pp}")
    trained = actor.ddp_model.params_with_grad  # what DDP reduces and the optimizer steps
    adapters = [p for name, p in actor.model.named_parameters() if p.requires_grad]
    result = {"history": [{key: step[key] for key in UPDATE_KEYS} for step in history],
              "base_unchanged": all(torch.equal(entry.param, frozen[entry.name])
                                    for entry in model_entries(actor.model, actor.model.hf_config)),
              "optimizer_params": len(trained), "adapter_params": len(adapters),
              "adapter_numel": sum(param.numel() for param in adapters),
              "trained_are_adapters": {id(p) for p in trained} == {id(p) for p in adapters},
              "only_adapters_trainable": all(".lora_adapter." in name for name, p in actor.model.named_parameters()
                                             if p.requires_grad),
              "reference_shares_the_model": reference.model is actor.model, "run_dir": str(run_dir)}
    parallel_state.destroy_model_parallel()
    return result


def _checkpoint_and_convert(actor, model_dir: str, run_dir: Path) -> Path:
    """The trainer's checkpoint of `actor` (rank files and its PEFT export) at step 2, converted by the ranks that
    wrote it to `run_dir/adapter` and, merged, to `run_dir/merged`."""
    from megatron_cpo.trainer.run.checkpoint_conversion import convert_run_checkpoint
    from megatron_cpo.trainer.run.checkpointing import CheckpointManager, hf_exporter

    step = CheckpointManager(run_dir, actor, None, export_hf=hf_exporter(actor, model_dir, "float32")).save(2)
    convert_run_checkpoint(step, run_dir / "adapter", model_dir, log=lambda message: None)
    convert_run_checkpoint(step, run_dir / "merged", model_dir, merge=True, log=lambda message: None)
    return run_dir


def _critic_case(model_dir: str) -> dict:
    """PPO's critic with LoRA (DP=2): its adapters and value head train, its decoder stays as loaded."""
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models.weight_mapping import model_entries
    from megatron_cpo.trainer.batch.sequences import pack_sequences
    from megatron_cpo.trainer.components import critic_for

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "algorithm.adv_estimator=gae", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2", "critic.optim.lr=1e-2",
        f"critic.model.lora.rank={RANK}", "critic.ppo_micro_batch_size_per_gpu=1"])
    platform.init_distributed(1, 1, seed=1)
    critic = critic_for(config, pad_token_id=0, total_steps=10)
    frozen = {entry.name: entry.param.detach().clone() for entry in model_entries(critic.model, critic.model.hf_config)
              if not entry.name.startswith("output_layer")}
    seqs = pack_sequences([[1, 5, 6, 7], [1, 9, 10]], [[11, 12, 13], [14, 15]], 0, 4)
    values = critic.values(seqs)
    metrics = critic.update(seqs, values - 0.1, torch.ones(2, 4) * seqs.response_mask())
    after = critic.values(seqs)
    trainable = sorted(name for name, param in critic.model.named_parameters() if param.requires_grad)
    result = {"trainable": trainable, "grad_norm": metrics["critic/grad_norm"],
              "moved": float((after - values).abs().max()),
              "decoder_unchanged": all(torch.equal(entry.param, frozen[entry.name])
                                       for entry in model_entries(critic.model, critic.model.hf_config)
                                       if entry.name in frozen)}
    parallel_state.destroy_model_parallel()
    return result


def _numpy(tree):
    """Tensors as numpy arrays: a tensor sent from a spawned process is a handle to its memory, gone with it."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().cpu().numpy()
    if isinstance(tree, dict):
        return {key: _numpy(value) for key, value in tree.items()}
    return tree


def all_cases(rank, world_size, dense_dir, moe_dir, work_dir):
    from megatron_cpo import platform

    results = {f"dense/{name}": _model_case(dense_dir, layout, work_dir, f"dense/{name}")
               for name, layout in DENSE_LAYOUTS.items()}
    results.update({f"moe/{name}": _model_case(moe_dir, layout, work_dir, f"moe/{name}")
                    for name, layout in MOE_LAYOUTS.items()})
    results.update({f"update/{tp}x{pp}": _two_updates(dense_dir, tp, pp, work_dir)
                    for tp, pp in ((1, 1), (2, 1), (1, 2))})
    results["critic"] = _critic_case(dense_dir)
    platform.destroy_distributed()
    return _numpy(results)


@pytest.fixture(scope="module")
def results(tied_qwen2_dir, tmp_path_factory):
    from megatron_cpo.models.tiny import write_tiny_model

    moe_dir = write_tiny_model(tmp_path_factory.mktemp("lora_moe") / "tiny-qwen3-moe", family="qwen3_moe", seed=0)
    work = tmp_path_factory.mktemp("lora_adapters")
    found = run_processes(all_cases, 2, str(tied_qwen2_dir), str(moe_dir), str(work))[0]
    return {**_tensors(found), "work": work, "dense_dir": tied_qwen2_dir}


def _tensors(tree):
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {key: _tensors(value) for key, value in tree.items()}
    return tree


def _max_difference(expected: dict, got: dict) -> float:
    assert sorted(expected) == sorted(got)
    return max(float((expected[name] - got[name]).abs().max()) for name in expected)


@pytest.mark.parametrize("case", [f"dense/{name}" for name in DENSE_LAYOUTS] + [f"moe/{name}" for name in MOE_LAYOUTS])
def test_zero_b_and_adapters_off_are_the_base_exactly(results, case):
    last = results[case]["last"]
    assert last["b0_exact"] and last["off_exact"]
    assert last["changed"] > 1e-3  # the adapters with B != 0 do change the model


@pytest.mark.parametrize("case", ["dense/tp2", "dense/tp2_sp", "dense/pp2", "moe/ep2", "moe/tp2_etp2_sp"])
def test_outputs_and_adapter_gradients_equal_tp1(results, case):
    reference, split = results[case.split("/")[0] + "/tp1"], results[case]
    assert float((split["last"]["logits"] - reference["last"]["logits"]).abs().max()) <= TOLERANCE
    assert split["last"]["loss"] == pytest.approx(reference["last"]["loss"], abs=TOLERANCE)
    grads = split["grads"]
    if case == "moe/ep2":  # both ranks scored the same tokens: each expert's gradient holds both ranks' share
        grads = {name: g / 2 if ".experts." in name else g for name, g in grads.items()}
    assert _max_difference(reference["grads"], grads) <= TOLERANCE
    assert max(float(g.abs().max()) for g in reference["grads"].values()) > 1e-4
    assert _max_difference(reference["peft"], split["peft"]) == 0  # the same initial adapters at every layout
    assert _max_difference(reference["merged"], split["merged"]) <= TOLERANCE


@pytest.mark.parametrize("case", [f"dense/{name}" for name in DENSE_LAYOUTS] + [f"moe/{name}" for name in MOE_LAYOUTS])
def test_an_adapter_exported_at_tp1_loads_at_every_layout(results, case):
    reference = results[case.split("/")[0] + "/tp1"]["last"]["logits"]
    assert float((results[case]["last"]["from_tp1"] - reference).abs().max()) <= TOLERANCE


def test_the_peft_export_loads_onto_the_hf_base_with_the_trainers_logits(results):
    """The real `peft`: `PeftModel.from_pretrained` on the tiny HF base with the TP=2 export gives the trainer's
    logits, and PEFT's own merge (`merge_and_unload`) gives the merged weights the trainer pushes."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(results["dense_dir"], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, results["work"] / "dense" / "tp2")
    with torch.no_grad():
        logits = peft_model(TOKENS).logits
    assert float((logits - results["dense/tp1"]["last"]["logits"]).abs().max()) <= TOLERANCE
    merged = peft_model.merge_and_unload().state_dict()
    pushed = results["dense/pp2"]["merged"]
    assert _max_difference({name: merged[name] for name in pushed}, pushed) <= TOLERANCE
    adapted = [name for name in pushed if name.endswith(("q_proj.weight", "down_proj.weight"))]
    base_weights = AutoModelForCausalLM.from_pretrained(results["dense_dir"], dtype=torch.float32).state_dict()
    assert adapted and all(float((pushed[name] - base_weights[name]).abs().max()) > 1e-6 for name in adapted)


def test_every_expert_carries_an_adapter_under_its_hf_name(results):
    names = results["moe/ep2"]["peft"]
    assert any(".mlp.experts.3.down_proj.lora_B" in name for name in names)  # rank 1's experts, gathered
    assert any(".self_attn.q_proj.lora_A" in name for name in names)


def test_lora_updates_agree_across_layouts_and_train_only_the_adapters(results):
    single = results["update/1x1"]
    assert single["history"][1]["actor/kl_loss"] > 0 and single["history"][0]["actor/grad_norm"] > 0
    for layout in ("update/2x1", "update/1x2"):
        for expected, got in zip(single["history"], results[layout]["history"]):
            for key in UPDATE_KEYS:
                assert got[key] == pytest.approx(expected[key], rel=1e-4, abs=1e-6), (layout, key)
    for layout in ("update/1x1", "update/2x1", "update/1x2"):
        case = results[layout]
        assert case["base_unchanged"] and case["only_adapters_trainable"] and case["reference_shares_the_model"]
        assert case["trained_are_adapters"] and case["optimizer_params"] == case["adapter_params"] > 0


@pytest.mark.parametrize("layout", ["update/1x1", "update/2x1", "update/1x2"])  # DP 2, TP 2, PP 2
def test_a_lora_runs_checkpoint_converts_at_its_layout_to_its_own_export(results, layout):
    """The checkpoint converter (trainer/run/checkpoint_conversion.py) on the ranks that wrote the checkpoint: its
    PEFT adapter is the run's own export, and merged it is what `merge-lora` makes of that export."""
    from safetensors.torch import load_file

    from megatron_cpo.models.lora.merge_command import merge_lora
    from megatron_cpo.models.lora.peft_format import ADAPTER_WEIGHTS

    run_dir = Path(results[layout]["run_dir"])
    export = run_dir / "step_000002" / "huggingface"
    converted, exported = load_file(run_dir / "adapter" / ADAPTER_WEIGHTS), load_file(export / ADAPTER_WEIGHTS)
    assert sorted(converted) == sorted(exported)
    assert all(torch.equal(converted[name], exported[name]) for name in exported)
    assert max(float(t.abs().max()) for name, t in exported.items() if ".lora_B." in name) > 1e-4  # trained
    reference = merge_lora(results["dense_dir"], export, run_dir / "reference_merge", log=lambda message: None)
    reference, merged = ({name: t for path in sorted(directory.glob("*.safetensors"))
                          for name, t in load_file(path).items()} for directory in (reference, run_dir / "merged"))
    assert sorted(merged) == sorted(reference)
    assert _max_difference(reference, merged) <= 1e-6


def test_a_lora_critic_trains_its_adapters_and_value_head_only(results):
    critic = results["critic"]
    assert critic["trainable"] and all(".lora_adapter." in name or name.startswith("output_layer.")
                                       for name in critic["trainable"])
    assert any(name.startswith("output_layer.") for name in critic["trainable"])
    assert critic["grad_norm"] > 0 and critic["moved"] > 0 and critic["decoder_unchanged"]


def test_the_memory_planner_counts_the_adapters_the_trainer_builds(results):
    """tools/plan_memory.py's adapter count per GPU equals the adapters the actor holds (TP 1, PP 1; TP 2: half)."""
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    from plan_memory import Layout, ModelShape, lora_stage_params

    shape = ModelShape.from_hf_config(json.loads((results["dense_dir"] / "config.json").read_text()))
    for tp in (1, 2):
        planned = lora_stage_params(shape, Layout(tp=tp, world_size=2, lora_rank=RANK))
        assert planned == {"dense": results[f"update/{tp}x1"]["adapter_numel"], "experts": 0}, tp
