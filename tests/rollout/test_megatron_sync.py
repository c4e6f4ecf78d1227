"""Megatron -> vLLM weight sync at TP=2/PP=1 and TP=1/PP=2 (real Megatron-Core over gloo, real engines on Ray), over
shared memory and, at PP=2, over the collective transport (a gloo group per sending rank; stages take turns). The
model has tied embeddings and qkv biases (`tied_qwen2_dir`): the first stage sends the embedding, which is also the
engine's output head; the last stage keeps its own copy of it as Megatron's output layer and sends none of it.

Every sending rank (TP rank 0 of each PP stage) pushes its own layers straight to the engines through
`send_from_pipeline_stages`, as the trainer's `push_weights` does; the manager opens and closes the reload. After the
sync the engines must generate, greedily, the tokens a transformers model holding the exported weights generates, and
their log-probs must match the Megatron model's own within 1e-4 (float32), and every engine worker must report each
of its parameters filled exactly once (`weight_sync.reload_problem`).
"""
import pytest
import torch

from megatron_cpo.rollout import SamplingParams
from tests.multiprocess import run_processes

PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90], [1, 33, 3], [1, 100, 101, 102, 103, 104]]
MAX_NEW_TOKENS = 10


def _megatron_sender(rank, world_size, model_dir, tp, pp, spec, prompts, max_new_tokens):
    """One trainer rank: build the model, change its weights, push this rank's export, then generate greedily."""
    import ray
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.models import (
        build_gpt_model,
        forward_logits,
        greedy_generate,
        iter_hf_weights,
        load_hf_config,
        load_hf_weights,
    )
    from megatron_cpo.rollout import close_weight_groups, send_from_pipeline_stages

    torch.set_num_threads(1)
    platform.init_distributed(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, seed=0)
    hf_config = load_hf_config(model_dir)
    model = build_gpt_model(hf_config, params_dtype=torch.float32)
    load_hf_weights(model, model_dir)
    # Same noise stream on every TP rank of a stage, so replicated parameters (norms) stay identical across TP; the
    # tied embedding and the last stage's copy of it (PP=2) get the same noise, as training keeps them equal.
    generator = torch.Generator().manual_seed(100 + parallel_state.get_pipeline_model_parallel_rank())
    with torch.no_grad():
        for name, param in model.named_parameters():
            shared = name.endswith(("embedding.word_embeddings.weight", "output_layer.weight"))
            noise_from = torch.Generator().manual_seed(99) if shared else generator
            param.add_(torch.randn(param.shape, generator=noise_from) * 0.05)

    exported = {}

    def recorded_export():
        for name, tensor in iter_hf_weights(model, hf_config):
            exported[name] = tensor.detach().cpu().numpy().copy()  # numpy: returned by value, not via fd sharing
            yield name, tensor

    metrics = send_from_pipeline_stages(spec, recorded_export(), parallel_state.get_pipeline_model_parallel_rank(),
                                        pp)
    close_weight_groups()
    if ray.is_initialized():
        ray.shutdown()

    greedy = []
    for prompt in prompts:
        new_tokens = greedy_generate(model, prompt, max_new_tokens, eos_token_id=hf_config.eos_token_id)
        logits = forward_logits(model, torch.tensor([prompt + new_tokens]))
        if logits is not None:
            log_probs = torch.log_softmax(logits[0].float(), dim=-1)
            positions = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(new_tokens))
            greedy.append((new_tokens, log_probs[positions, torch.tensor(new_tokens)].tolist()))
    is_last_stage = parallel_state.is_pipeline_last_stage()
    platform.destroy_distributed()
    return {"weights": exported, "metrics": metrics, "greedy": greedy if is_last_stage else None}


@pytest.mark.parametrize("tp, pp, transport", [(2, 1, "shm"), (1, 2, "shm"), (1, 2, "collective")],
                         ids=["tp2-pp1-shm", "tp1-pp2-shm", "tp1-pp2-collective"])
def test_megatron_weights_synced_into_engines_match_transformers_tokens_and_megatron_logprobs(
        manager, tied_qwen2_dir, tp, pp, transport):
    from transformers import AutoModelForCausalLM

    from megatron_cpo.rollout.weight_sync import reload_problem

    manager.begin_weight_sync()
    try:
        ranks = run_processes(_megatron_sender, 2, str(tied_qwen2_dir), tp, pp, manager.sender_spec(transport),
                              PROMPTS, MAX_NEW_TOKENS)
    finally:
        reports = manager.finish_weight_sync()
    assert len(reports) == 2 and reload_problem(reports) is None, reports

    exported = {name: torch.from_numpy(array) for result in ranks for name, array in result["weights"].items()}
    if pp == 2:  # each stage sent only its own layers (over its own group with the collective transport)
        assert ranks[0]["metrics"]["tensors"] > 0 and ranks[1]["metrics"]["tensors"] > 0
        assert all(("group_init_seconds" in r["metrics"]) == (transport == "collective") for r in ranks)
        assert not set(ranks[0]["weights"]) & set(ranks[1]["weights"])
    else:  # TP rank 1 gathers but does not send
        assert ranks[1]["metrics"]["tensors"] == 0
    hf_model = AutoModelForCausalLM.from_pretrained(tied_qwen2_dir, dtype=torch.float32)
    assert "lm_head.weight" not in exported  # tied: the embedding is the head
    missing, unexpected = hf_model.load_state_dict(exported, strict=False)
    assert missing == ["lm_head.weight"] and not unexpected
    assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
    assert sum(r["metrics"]["bytes"] for r in ranks) == sum(t.numel() * 4 for t in exported.values())
    megatron_greedy = next(r["greedy"] for r in reversed(ranks) if r["greedy"] is not None)

    for i, prompt in enumerate(PROMPTS):
        manager.submit(f"megatron-{tp}-{pp}-{transport}-{i}", prompt,
                       SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS, stop_token_ids=()))
    groups = {int(g.request_id.rsplit("-", 1)[1]): g for g in manager.completed(timeout=300)}
    assert {g.engine_index for g in groups.values()} == {0, 1}, "both engines must have received the weights"
    max_diff = 0.0
    for i, prompt in enumerate(PROMPTS):
        sample = groups[i].samples[0]
        megatron_tokens, megatron_log_probs = megatron_greedy[i]
        with torch.no_grad():
            hf_logits = hf_model(torch.tensor([prompt + sample.token_ids])).logits[0]
        hf_greedy = hf_logits[len(prompt) - 1:-1].argmax(-1).tolist()
        assert sample.token_ids == hf_greedy == megatron_tokens
        max_diff = max(max_diff, max(abs(a - b) for a, b in zip(sample.logprobs, megatron_log_probs)))
    print(f"TP={tp} PP={pp} {transport}: max |engine - Megatron| log-prob difference {max_diff:.2e}")
    assert max_diff < 1e-4
