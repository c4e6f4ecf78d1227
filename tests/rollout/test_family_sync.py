"""Weight pushes from Megatron into a real vLLM engine for the Qwen3 and Qwen3-MoE families (one engine each, Ray,
shared by this module's tests), and a whole Qwen3 training run on the same engine.

The trainer side runs in this process at TP=1 (real Megatron-Core over a one-process gloo group): it loads the tiny
model, changes every weight, pushes its export (`iter_hf_weights`) into the engine, and does it again with other
weights. After each push the engine's greedy tokens must equal those of a transformers model holding the exported
weights, and the engine's log-probs must equal the Megatron model's own (float32, <= 1e-4). For Qwen3-MoE both
pushes are reloads of the CPU MoE layers, which vLLM 0.32 leaves in checkpoint layout unless
`rollout/moe_reload.py` prepacks them; a third push comes from two spawned ranks at EP=2 (each holds two of the
four experts; the export gathers them).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from megatron_cpo.models.tiny import write_tiny_model
from tests.multiprocess import run_processes
from tests.rollout.conftest import tiny_rollout_config
from tests.rollout.servers import PROMPTS, greedy_log_prob_gap

TOLERANCE = 1e-4
MAX_NEW_TOKENS = 8


def _perturbed(model, seed: int) -> None:
    """Add the same noise stream to every rank's parameters (replicated ones stay equal across ranks)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)


def _push(model, spec) -> dict[str, torch.Tensor]:
    """Push this rank's export into the engines; returns what it exported (copies)."""
    from megatron_cpo.models import iter_hf_weights
    from megatron_cpo.rollout import close_weight_groups, send_from_pipeline_stages

    exported = {}

    def recorded():
        for name, tensor in iter_hf_weights(model, model.hf_config):
            exported[name] = tensor.detach().clone()
            yield name, tensor

    send_from_pipeline_stages(spec, recorded(), 0, 1)
    close_weight_groups()
    return exported


def _engine_log_probs_of_megatron(model, groups) -> list[list[float]]:
    """Megatron's log-probs of each group's engine tokens (collective over the model's ranks)."""
    from megatron_cpo.models import forward_logits

    result = []
    for group in groups:
        tokens = group.prompt_token_ids + group.samples[0].token_ids
        logits = forward_logits(model, torch.tensor([tokens]))
        if logits is not None:
            log_probs = torch.log_softmax(logits[0].float(), dim=-1)
            positions = torch.arange(len(group.prompt_token_ids) - 1, len(tokens) - 1)
            result.append(log_probs[positions, torch.tensor(group.samples[0].token_ids)].tolist())
    return result


def _ep2_sender(rank: int, world_size: int, model_dir: str, spec, seed: int) -> dict:
    """One of two trainer ranks at EP=2: load, change the weights, push (rank 0 sends every expert)."""
    import ray

    from megatron_cpo import platform
    from megatron_cpo.models import build_gpt_model, load_hf_config, load_hf_weights

    torch.set_num_threads(1)
    platform.init_distributed(expert_model_parallel_size=2, seed=0)
    model = build_gpt_model(load_hf_config(model_dir))
    load_hf_weights(model, model_dir)
    _perturbed(model, seed)
    exported = {name: tensor.numpy() for name, tensor in _push(model, spec).items()}
    if ray.is_initialized():
        ray.shutdown()
    platform.destroy_distributed()
    return {"exported": exported}


def _transformers_with(exported: dict[str, torch.Tensor], model_dir: Path, out: Path):
    """A transformers model holding the exported tensors (saved in the HF layout, so per-expert tensors load too)."""
    from transformers import AutoModelForCausalLM

    out.mkdir()
    shutil.copy(model_dir / "config.json", out / "config.json")
    save_file({name: tensor.contiguous() for name, tensor in exported.items()}, out / "model.safetensors")
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def _generate(manager, tag: str):
    from megatron_cpo.rollout import SamplingParams

    for index, prompt in enumerate(PROMPTS):
        manager.submit(f"{tag}-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))
    return sorted(manager.completed(timeout=300), key=lambda group: group.request_id)


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def family_engine(request, ray_cluster, tmp_path_factory):
    """A tiny model of the family (random norms) and one float32 engine serving it, for this module's tests."""
    from megatron_cpo.rollout import RolloutManager

    model_dir = write_tiny_model(tmp_path_factory.mktemp(request.param) / request.param, request.param, seed=3,
                                 random_norms=True)
    manager = RolloutManager(tiny_rollout_config(model_dir, num_engines=1))
    yield request.param, model_dir, manager
    manager.shutdown()


def test_pushes_from_megatron_give_transformers_tokens_and_megatron_log_probs(family_engine, tmp_path):
    from megatron_cpo import platform
    from megatron_cpo.models import build_gpt_model, load_hf_config, load_hf_weights

    family, model_dir, manager = family_engine
    saved_environment = dict(os.environ)
    platform.init_distributed(seed=0)
    try:
        model = build_gpt_model(load_hf_config(model_dir))
        load_hf_weights(model, model_dir)
        for push in range(2):
            _perturbed(model, seed=10 + push)
            manager.begin_weight_sync()
            try:
                exported = _push(model, manager.sender_spec("shm"))
            finally:
                manager.finish_weight_sync()
            groups = _generate(manager, f"{family}-push{push}")
            hf_gap = greedy_log_prob_gap(_transformers_with(exported, model_dir, tmp_path / f"push{push}"), groups)
            megatron = _engine_log_probs_of_megatron(model, groups)
            gap = max(abs(a - b) for group, expected in zip(groups, megatron)
                      for a, b in zip(group.samples[0].logprobs, expected))
            print(f"{family} push {push}: |engine - transformers| {hf_gap:.1e}, |engine - Megatron| {gap:.1e}")
            assert hf_gap < TOLERANCE and gap < TOLERANCE
    finally:
        platform.destroy_distributed()
        os.environ.clear()
        os.environ.update(saved_environment)
    if family != "qwen3_moe":
        return
    manager.begin_weight_sync()
    try:
        ranks = run_processes(_ep2_sender, 2, str(model_dir), manager.sender_spec("shm"), 20)
    finally:
        manager.finish_weight_sync()
    exported = {name: torch.from_numpy(array) for name, array in ranks[0]["exported"].items()}
    assert ranks[1]["exported"] == {} and sum(".experts." in name for name in exported) == 2 * 4 * 3
    groups = _generate(manager, f"{family}-ep2")
    hf_gap = greedy_log_prob_gap(_transformers_with(exported, model_dir, tmp_path / "ep2"), groups)
    print(f"{family} EP=2 push: |engine - transformers| {hf_gap:.1e}")
    assert hf_gap < TOLERANCE


@pytest.mark.parametrize("family_engine", ["qwen3"], indirect=True)
def test_a_qwen3_grpo_run_on_the_engine_keeps_engine_and_trainer_log_probs_equal(family_engine, tmp_path):
    """Three GRPO steps of the whole trainer (this process, TP=1) on the engine the pushes above used: after every
    step's push the engine's log-probs of its own samples equal the trainer's old log-probs to float32 noise."""
    import json

    from megatron_cpo.config import build_config
    from megatron_cpo.data.synthetic import ArithConfig, write_arith_parquet
    from megatron_cpo.trainer.assemble import run_training

    _, model_dir, manager = family_engine
    data = write_arith_parquet(tmp_path / "data", ArithConfig(num_train=16, num_test=4))
    saved_environment = dict(os.environ)
    try:
        last = run_training(build_config({}, [
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}",
            f"data.val_files={data['test']}", "data.train_batch_size=2", "data.max_prompt_length=384",
            "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.optim.lr=1e-3",
            "trainer.val_before_train=false", "trainer.total_training_steps=3", "reward.num_workers=1",
            "reward.custom_reward_function=tests.trainer.graders:even_first_character",
            f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[jsonl]"]), manager)
    finally:
        os.environ.clear()
        os.environ.update(saved_environment)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3] and "val/acc" in last
    mismatch = [row["mismatch/log_probs_diff_max"] for row in rows]
    print(f"qwen3 GRPO run: mismatch/log_probs_diff_max per step {mismatch}")
    assert all(diff < 1e-4 for diff in mismatch), mismatch
    assert all(row["actor/grad_norm"] > 0 for row in rows)
