"""The fused lm-head path, token-budget micro-batches and padding-free packing give the padded path's numbers (real
Megatron, gloo).

For each layout (DP=2, TP=2, PP=2 on two processes) and a model with tied embeddings and a vocabulary that TP=2 must
pad (101 tokens), the actor's and the reference's log-probs and entropy, the update's loss terms, the gradient buffers
and the gradient norm of the fused (`use_fused_kernels`), the dynamic (`use_dynamic_bsz`) and the fused + dynamic
paths, and the packed (`use_remove_padding`: THD with the default fused attention, position ids restarting and
attention confined per sequence) and packed + fused + dynamic paths must equal those of the padded logits path within
1e-5 (fp32). The rows are length-skewed and the token budget small, so the dynamic path cuts uneven micro-batches of
different lengths (and, at DP=2, uneven row shares).
The learning rate is 1e-12, so the (Adam) updates leave the fp32 weights as they are and every path sees the same
model. Plain DDP all-reduces the whole gradient buffer (the distributed optimizer would leave the other ranks' shards
unreduced), so the buffers can be compared on every rank. An untied model (Qwen2, real vocabulary 128) checks the
output-layer weight at TP=2. One spawned pair of processes runs every case to pay the start-up once.
"""
import torch

from megatron_cpo.models.tiny import write_tiny_model
from tests.multiprocess import run_processes

RECOMPUTE = "actor_rollout_ref.model.enable_gradient_checkpointing=true"
SELECTIVE = "actor_rollout_ref.actor.megatron.recompute_granularity=selective"
SEQUENCE_PARALLEL = "actor_rollout_ref.actor.megatron.sequence_parallel=true"
# mode: (use_fused_kernels, use_dynamic_bsz, use_remove_padding, overrides the policies are rebuilt with)
MODES = {"fused": (True, False, False, ()), "dynamic": (False, True, False, ()),
         "fused_dynamic": (True, True, False, ()), "packed": (False, False, True, ()),
         "packed_fused_dynamic": (True, True, True, ()),
         "recompute_full": (False, False, False, (RECOMPUTE,)),
         "recompute_selective_packed_dynamic": (False, True, True, (RECOMPUTE, SELECTIVE)),
         "sequence_parallel": (False, False, False, (SEQUENCE_PARALLEL,)),
         "sequence_parallel_packed_fused_dynamic": (True, True, True, (SEQUENCE_PARALLEL,))}
# the modes each case runs (CI time): packing everywhere, recompute at DP=2 and PP=2, sequence parallelism at TP=2
CASES = {(1, 1): ("fused", "dynamic", "fused_dynamic", "packed", "packed_fused_dynamic",
                  "recompute_selective_packed_dynamic"),
         (2, 1): ("fused", "dynamic", "packed", "packed_fused_dynamic", "sequence_parallel",
                  "sequence_parallel_packed_fused_dynamic"),
         (1, 2): ("fused", "dynamic", "packed", "packed_fused_dynamic", "recompute_full"),
         "untied": ("fused", "fused_dynamic", "packed_fused_dynamic", "sequence_parallel_packed_fused_dynamic")}
LOSS_KEYS = ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm")


def _batch():
    from megatron_cpo.trainer.batch.sequences import pack_sequences

    generator = torch.Generator().manual_seed(0)
    prompt_lengths = [3, 6, 4, 5, 3, 4, 6, 5]
    response_lengths = [20, 2, 9, 1, 14, 4, 0, 7]
    prompts = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in prompt_lengths]
    responses = [torch.randint(3, 100, (n,), generator=generator).tolist() for n in response_lengths]
    seqs = pack_sequences(prompts, responses, pad_token_id=0, response_width=24)
    mask = seqs.response_mask()
    advantages = torch.randn(8, 1, generator=generator).expand(8, 24) * mask
    return seqs, advantages, mask


def _results(actor, reference, config):
    from megatron_cpo.trainer.workers.actor import UpdateInputs

    seqs, advantages, mask = _batch()
    log_probs, entropy = actor.log_probs(seqs, temperature=0.7)
    ref_log_probs, ref_entropy = reference.log_probs(seqs, temperature=0.7)
    old = (log_probs - 0.05 * mask).detach()
    metrics = actor.update(seqs, UpdateInputs(advantages, old, ref_log_probs, None), 0.7)
    grads = torch.cat([p.main_grad.detach().reshape(-1).clone() for p in actor.model.parameters()])
    return {"log_probs": log_probs, "entropy": entropy, "ref_log_probs": ref_log_probs, "ref_entropy": ref_entropy,
            "grads": grads, **{key: torch.tensor(metrics[key]) for key in LOSS_KEYS}}


def _micro_batches(actor_config, micro_rows, budgets=None):
    """The actor settings with `micro_rows`-row micro-batches, or (budgets: update, log-prob) token budgets."""
    from dataclasses import replace

    update_budget, log_prob_budget = budgets or (actor_config.ppo_max_token_len_per_gpu,
                                                 actor_config.log_prob_max_token_len_per_gpu)
    return replace(actor_config, ppo_micro_batch_size_per_gpu=micro_rows, use_dynamic_bsz=budgets is not None,
                   ppo_max_token_len_per_gpu=update_budget, log_prob_max_token_len_per_gpu=log_prob_budget)


def _compare_modes(model_dir, tp, pp, modes):
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models.builder import packing_layout
    from megatron_cpo.trainer.components import policies_for

    base = [
        f"actor_rollout_ref.model.path={model_dir}", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.optim.lr=1e-12", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.entropy_coeff=0.01",
        "actor_rollout_ref.actor.megatron.use_distributed_optimizer=false",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}"]
    config = build_config({}, base)
    platform.init_distributed(tp, pp, seed=1)
    policies = {(): policies_for(config, pad_token_id=0, total_updates=10)}
    padded = _results(*policies[()], config)
    differences = {}
    for mode in modes:
        fused, dynamic, packed, overrides = MODES[mode]
        if overrides not in policies:
            policies[overrides] = policies_for(build_config({}, base + list(overrides)), 0, 10)
        actor, reference = policies[overrides]
        for policy in (actor, reference):
            policy.use_fused_kernels = fused
            actor_config = config.actor_rollout_ref.actor
            policy.config = _micro_batches(actor_config, 2, (30, 40) if dynamic else None)
            if packed:  # budgets of real tokens big enough (and fixed micro-batches of 4) that rows hold several
                policy.config = _micro_batches(actor_config, 2, (60, 200)) if dynamic else _micro_batches(
                    actor_config, 4)
            policy.packing = packing_layout(policy.model) if packed else None
            if (dynamic or packed) and pp > 1:
                policy.model.config.variable_seq_lengths = True
        got = _results(actor, reference, config)
        differences[mode] = {key: float((got[key] - padded[key]).abs().max()) for key in padded}
    parallel_state.destroy_model_parallel()
    summary = {key: float(value.abs().sum()) for key, value in padded.items()}  # plain floats cross the queue
    return summary, differences


def _all_cases(rank, world_size, tied_dir, untied_dir):
    from megatron_cpo import platform

    results = {(tp, pp): _compare_modes(tied_dir, tp, pp, CASES[tp, pp]) for tp, pp in ((1, 1), (2, 1), (1, 2))}
    results["untied"] = _compare_modes(untied_dir, 2, 1, CASES["untied"])
    platform.destroy_distributed()
    return results


def test_fused_and_dynamic_paths_equal_the_padded_path(tmp_path):
    tied = str(write_tiny_model(tmp_path / "tied", family="llama", vocab_size=101))
    untied = str(write_tiny_model(tmp_path / "untied", family="qwen2"))
    for rank_results in run_processes(_all_cases, 2, tied, untied):
        for case, (padded, differences) in rank_results.items():
            assert padded["actor/grad_norm"] > 0 and padded["actor/kl_loss"] >= 0, case
            assert padded["log_probs"] > 0 and padded["ref_entropy"] > 0 and padded["grads"] > 0, case
            assert set(differences) == set(CASES[case]), case
            for mode, diff in differences.items():
                for key, value in diff.items():
                    assert value <= 1e-5, (case, mode, key, value)
