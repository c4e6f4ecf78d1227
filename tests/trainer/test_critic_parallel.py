"""PPO's critic (real Megatron-Core over gloo, two processes): its values and the gradient of its clipped value loss
are the same at TP=2 (with and without sequence parallelism) and PP=2 as at TP=1 (there DP=2, the rows split over
the two ranks), to 1e-5, on the tied tiny Llama (the critic is built untied: its head replaces the lm-head). One
optimizer step later the values still agree. A critic exported at TP=2 is the one-label token-classification model
transformers loads, and it gives the Megatron critic's values; loaded back as `critic.model.path`, its head is kept.
"""
import pytest
import torch

from tests.multiprocess import run_processes

LAYOUTS = ((1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False))  # TP, PP, sequence parallel


def batch():
    """Four prompt + response rows of different lengths, response width 6, and returns to learn."""
    from megatron_cpo.trainer.batch.sequences import pack_sequences

    generator = torch.Generator().manual_seed(0)
    prompts = [[1, 5, 6, 7, 8], [1, 9, 10, 11], [1, 5, 6], [1, 12, 13, 14, 15, 16]]
    responses = [torch.randint(3, 100, (length,), generator=generator).tolist() for length in (4, 6, 1, 3)]
    seqs = pack_sequences(prompts, responses, 0, 6)
    returns = torch.randn(4, 6, generator=generator) * seqs.response_mask()
    return seqs, returns


def hf_gradients(model) -> dict[str, torch.Tensor]:
    """This rank's exported share of the model's gradient (`main_grad`) under HF names: the weights' export with
    every parameter's data swapped for its gradient."""
    from megatron_cpo.models import iter_hf_weights

    saved = {}
    for param in model.parameters():
        saved[param] = param.data
        param.data = param.main_grad.to(param.dtype)
    try:
        return {name: tensor.clone() for name, tensor in iter_hf_weights(model, model.hf_config)}
    finally:
        for param, data in saved.items():
            param.data = data


def one_layout(model_dir, export_dir, tp, pp, sequence_parallel):
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.models.conversion_commands import export_hf_model
    from megatron_cpo.trainer.components import critic_for

    config = build_config({}, [
        f"actor_rollout_ref.model.path={model_dir}", "algorithm.adv_estimator=gae", "data.train_batch_size=2",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
        f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pp}",
        f"actor_rollout_ref.actor.megatron.sequence_parallel={sequence_parallel}",
        # lr 1e-3: Adam's first step moves every weight by about lr whatever its gradient's size, so a rounding-level
        # difference in a near-zero gradient element is an lr-sized difference in the weights (1e-2 gave 1.5e-5)
        "critic.ppo_micro_batch_size_per_gpu=1", "critic.optim.lr=1e-3", "critic.cliprange_value=0.05",
        "critic.megatron.use_distributed_optimizer=false"])  # every DP rank then holds the whole gradient
    platform.init_distributed(tp, pp, seed=1)
    critic = critic_for(config, pad_token_id=0, total_steps=10)
    seqs, returns = batch()
    values = critic.values(seqs)
    old_values = values - 0.1  # so that part of the loss is clipped
    metrics, _ = critic.accumulate_gradients(seqs, old_values, returns)
    gradients = hf_gradients(critic.model)
    update = critic.update(seqs, old_values, returns)
    after = critic.values(seqs)
    if export_dir is not None:
        export_hf_model(critic.model, critic.model.hf_config, model_dir, export_dir)
    parallel_state.destroy_model_parallel()
    # numpy arrays: a tensor sent from a spawned process is a handle to its memory, gone when the process ends
    return {"values": values.numpy(), "after": after.numpy(), "metrics": metrics, "update": update,
            "gradients": {name: grad.cpu().numpy() for name, grad in gradients.items()}}


def every_layout(rank, world_size, model_dir, export_dir):
    from megatron_cpo import platform

    results = {layout: one_layout(model_dir, export_dir if layout == (2, 1, True) else None, *layout)
               for layout in LAYOUTS}
    platform.destroy_distributed()
    return results


def test_tp2_and_pp2_critic_values_and_gradients_equal_tp1(tied_llama_dir, tmp_path):
    export_dir = tmp_path / "critic_hf"
    ranks = run_processes(every_layout, 2, str(tied_llama_dir), str(export_dir))
    for rank in ranks:
        for result in rank.values():
            result["values"], result["after"] = torch.from_numpy(result["values"]), torch.from_numpy(result["after"])
    gradients = {layout: {name: torch.from_numpy(grad) for rank in ranks
                          for name, grad in rank[layout]["gradients"].items()} for layout in LAYOUTS}
    reference = ranks[0][(1, 1, False)]
    assert reference["metrics"]["critic/vf_clipfrac"] > 0 and reference["metrics"]["critic/vf_loss"] > 0
    assert "score.weight" in gradients[(1, 1, False)] and "lm_head.weight" not in gradients[(1, 1, False)]
    assert float(gradients[(1, 1, False)]["model.layers.0.self_attn.q_proj.weight"].abs().max()) > 0
    for layout in LAYOUTS[1:]:
        for rank in ranks:
            torch.testing.assert_close(rank[layout]["values"], reference["values"], atol=1e-5, rtol=0)
            torch.testing.assert_close(rank[layout]["after"], reference["after"], atol=1e-5, rtol=0)
            for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean"):
                assert rank[layout]["metrics"][key] == pytest.approx(reference["metrics"][key], abs=1e-6), key
            assert rank[layout]["update"]["critic/grad_norm"] == pytest.approx(
                reference["update"]["critic/grad_norm"], rel=1e-5)
        assert gradients[layout].keys() == gradients[(1, 1, False)].keys()
        for name, expected in gradients[(1, 1, False)].items():
            torch.testing.assert_close(gradients[layout][name], expected, atol=1e-5, rtol=0, msg=f"{layout} {name}")
    assert not torch.equal(reference["after"], reference["values"])  # the step moved the values

    # the export (written at TP=2 with sequence parallelism, after the update) is transformers' value model
    from transformers import AutoModelForTokenClassification

    exported = AutoModelForTokenClassification.from_pretrained(export_dir).eval()
    assert exported.config.num_labels == 1 and not exported.config.token_classification_bias
    seqs, _ = batch()
    with torch.no_grad():
        values = seqs.to_response(exported(input_ids=seqs.tokens).logits.squeeze(-1))
    torch.testing.assert_close(values, ranks[0][(2, 1, True)]["after"], atol=1e-5, rtol=0)


def start_from_export(rank, world_size, model_dir, export_dir):
    """A critic whose `critic.model.path` is an exported critic keeps the exported head (TP=2 here)."""
    from megatron_cpo import platform
    from megatron_cpo.config import build_config
    from megatron_cpo.trainer.components import critic_for

    config = build_config({}, [f"actor_rollout_ref.model.path={model_dir}", "algorithm.adv_estimator=gae",
                               f"critic.model.path={export_dir}", "data.train_batch_size=2",
                               "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                               "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2"])
    platform.init_distributed(2, 1, seed=1)
    values = critic_for(config, pad_token_id=0, total_steps=1).values(batch()[0])
    platform.destroy_distributed()
    return values.numpy()


def test_an_exported_critic_starts_the_next_run(tied_llama_dir, tmp_path):
    from transformers import AutoModelForTokenClassification, LlamaForTokenClassification

    # a critic as verl's FSDP trainer saves it: transformers' token classification, with a biased score head
    torch.manual_seed(3)
    hf = LlamaForTokenClassification.from_pretrained(tied_llama_dir, num_labels=1)
    with torch.no_grad():
        hf.score.bias.fill_(0.25)
    hf.save_pretrained(tmp_path / "verl_critic")
    expected = AutoModelForTokenClassification.from_pretrained(tmp_path / "verl_critic").eval()
    seqs, _ = batch()
    with torch.no_grad():
        reference = seqs.to_response(expected(input_ids=seqs.tokens).logits.squeeze(-1))
    for values in run_processes(start_from_export, 2, str(tied_llama_dir), str(tmp_path / "verl_critic")):
        torch.testing.assert_close(torch.from_numpy(values), reference, atol=1e-5, rtol=0)
