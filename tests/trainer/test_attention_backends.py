"""torch's fused attention (`attention_backend=auto` without Transformer Engine) computes what Megatron-Core's local
attention computes, through the actor (real Megatron, gloo, two processes).

For a tiny Qwen2 (qkv biases, untied), Llama (tied) and Qwen3 (q/k norms) at TP=1 (DP=2), TP=2 and PP=2, and a Qwen2
with a sliding window on one layer at TP=1: the actor's log-probs and entropy, the update's loss terms, its gradient
buffers and gradient norm with the fused attention, on padded rows and on packed sequences (THD: one fused call per
sequence), equal those of the local attention on padded rows within 1e-5 (float32). The local attention's own packed
path (bin-packed rows under a block-diagonal mask) is compared too (Qwen2, every layout), and in bfloat16 (Llama,
TP=1) the fused attention stays within bfloat16's tolerance of the local one. The learning rate is 1e-12, so every
pass sees the same weights.
One spawned pair of processes runs every case to pay the start-up once.
"""
import pytest
import torch

from megatron_cpo.models.tiny import write_tiny_model
from tests.multiprocess import run_processes

FAMILIES = ("qwen2", "llama", "qwen3")
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "pp2": (1, 2)}
WINDOW = {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}  # layer 1 of 2 slides
KEYS = ("log_probs", "entropy", "grads", "actor/pg_loss", "actor/entropy", "actor/grad_norm")


def _batch():
    from megatron_cpo.trainer.batch.sequences import pack_sequences

    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (3, 6, 4, 5, 3, 4, 6, 5)]
    responses = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in (20, 2, 9, 1, 14, 4, 0, 7)]
    seqs = pack_sequences(prompts, responses, pad_token_id=0, response_width=24)
    mask = seqs.response_mask()
    advantages = torch.randn(8, 1, generator=generator).expand(8, 24) * mask
    return seqs, advantages, mask


def _results(actor, packed: bool) -> dict[str, torch.Tensor]:
    from megatron_cpo.models.builder import packing_layout
    from megatron_cpo.trainer.workers.actor import UpdateInputs

    actor.packing = packing_layout(actor.model) if packed else None
    seqs, advantages, mask = _batch()
    log_probs, entropy = actor.log_probs(seqs, temperature=0.7)
    metrics = actor.update(seqs, UpdateInputs(advantages, (log_probs - 0.05 * mask).detach(), None, None), 0.7)
    grads = torch.cat([p.main_grad.detach().reshape(-1).clone() for p in actor.model.parameters()])
    return {"log_probs": log_probs, "entropy": entropy, "grads": grads,
            **{key: torch.tensor(metrics[key]) for key in KEYS[3:]}}


def _actor(model_dir: str, tp: int, pp: int, backend: str, dtype: str = "float32"):
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import policies_for

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.optim.lr=1e-12", "actor_rollout_ref.actor.use_kl_loss=false",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
        f"actor_rollout_ref.actor.megatron.params_dtype={dtype}",
        f"actor_rollout_ref.actor.megatron.attention_backend={backend}",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"])
    actor, _ = policies_for(config, pad_token_id=0, total_updates=10)
    if pp > 1:
        actor.model.config.variable_seq_lengths = True  # packed micro-batches differ in shape
    return actor


def _differences(model_dir: str, tp: int, pp: int, local_packed: bool = True, dtype: str = "float32") -> dict:
    """Max |difference| from the local attention's padded results, per path and key; plus the reference's sizes."""
    local = _actor(model_dir, tp, pp, "local", dtype)
    reference = _results(local, packed=False)
    paths = {"local_packed": (local, True)} if local_packed else {}
    fused = _actor(model_dir, tp, pp, "auto", dtype)
    assert fused.model.attention_kind == "torch" and local.model.attention_kind == "local"
    paths.update(fused_padded=(fused, False), fused_packed=(fused, True))
    differences = {name: {key: float((value.float() - reference[key].float()).abs().max())
                          for key, value in _results(actor, packed).items()} for name, (actor, packed) in paths.items()}
    return {"differences": differences, "sizes": {key: float(value.float().abs().sum()) for key, value in
                                                  reference.items()}}


def _all_cases(rank, world_size, model_dirs):
    from megatron.core import parallel_state

    from megatron_cpo import platform

    results = {}
    for layout, (tp, pp) in LAYOUTS.items():
        platform.init_distributed(tp, pp, seed=1)
        for family in FAMILIES:
            # the local attention's packed rows (unchanged by the fused attention) once per layout
            results[layout, family] = _differences(model_dirs[family], tp, pp, local_packed=family == "qwen2")
        if layout == "tp1":
            results[layout, "qwen2_window"] = _differences(model_dirs["qwen2_window"], tp, pp, local_packed=False)
            results[layout, "llama_bf16"] = _differences(model_dirs["llama"], tp, pp, local_packed=False,
                                                         dtype="bfloat16")
        parallel_state.destroy_model_parallel()
    platform.destroy_distributed()
    return results


@pytest.fixture(scope="module")
def attention_runs(tmp_path_factory):
    work = tmp_path_factory.mktemp("attention")
    dirs = {family: str(write_tiny_model(work / family, family, seed=3, random_norms=True)) for family in FAMILIES}
    dirs["qwen2_window"] = str(write_tiny_model(work / "qwen2_window", "qwen2", seed=3, **WINDOW))
    return run_processes(_all_cases, 2, dirs)


CASES = [(layout, family) for layout in LAYOUTS for family in FAMILIES] + [("tp1", "qwen2_window")]


@pytest.mark.parametrize("layout,family", CASES)
def test_fused_attention_equals_the_local_one_padded_and_packed(attention_runs, layout, family):
    for rank_results in attention_runs:
        case = rank_results[layout, family]
        assert case["sizes"]["log_probs"] > 0 and case["sizes"]["grads"] > 0 and case["sizes"]["actor/grad_norm"] > 0
        for path, differences in case["differences"].items():
            for key, value in differences.items():
                assert value <= 1e-5, (layout, family, path, key, value)


def test_fused_attention_in_bfloat16_stays_within_its_tolerance(attention_runs):
    for rank_results in attention_runs:
        case = rank_results["tp1", "llama_bf16"]
        for path, differences in case["differences"].items():
            assert differences["log_probs"] <= 5e-2 and differences["entropy"] <= 5e-2, (path, differences)
            assert differences["actor/grad_norm"] <= 2e-2 * case["sizes"]["actor/grad_norm"], (path, differences)
