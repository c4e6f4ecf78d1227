"""Generation through two real vLLM engines on Ray: load balancing, streaming, seeds, stops, cancel, health, and a
weight sync from a transformers model checked token-for-token and log-prob-for-log-prob, greedy and sampled at a
temperature (the engines report the tempered log-probs the trainer recomputes)."""
import torch

from megatron_cpo.rollout import SamplingParams
from tests.rollout.servers import greedy_log_prob_gap

PROMPTS = [[1, 40 + i, 50 + i, 60 + (i % 7)] for i in range(8)]


def _collect(manager, timeout=300.0):
    return list(manager.completed(timeout=timeout))


def test_batch_is_split_between_two_engines_and_every_prompt_returns_once(manager):
    params = SamplingParams(n=2, temperature=1.0, max_tokens=12, seed=0)
    for i, prompt in enumerate(PROMPTS):
        manager.submit(f"split-{i}", prompt, params)
    assert sorted(request.engine_index for request in manager._requests()) == [0] * 4 + [1] * 4
    groups = _collect(manager)
    assert sorted(g.request_id for g in groups) == sorted(f"split-{i}" for i in range(8))
    assert {g.engine_index for g in groups} == {0, 1}
    assert manager.finished(timeout=0) == []  # nothing outstanding
    for group in groups:
        assert group.prompt_token_ids == PROMPTS[int(group.request_id.split("-")[1])]
        assert len(group.samples) == 2
        for sample in group.samples:
            assert len(sample.token_ids) == len(sample.logprobs) >= 1
            assert all(lp <= 0 for lp in sample.logprobs)
            assert sample.truncated == (sample.finish_reason == "length")


def test_seeded_groups_reproduce_on_either_engine_and_samples_differ(manager):
    params = SamplingParams(n=4, temperature=1.0, max_tokens=16, seed=1234)
    for copy in range(2):  # least-loaded dispatch puts the two copies on different engines
        manager.submit(f"seeded-{copy}", PROMPTS[0], params)
    first, second = sorted(_collect(manager), key=lambda g: g.request_id)
    assert first.engine_index != second.engine_index
    assert [s.token_ids for s in first.samples] == [s.token_ids for s in second.samples]
    assert len({tuple(s.token_ids) for s in first.samples}) > 1


def test_seeded_batch_larger_than_one_prefill_step_completes(manager):
    """Seeded samples whose prompts do not fit one scheduler step (prefill chunking crashed vLLM's CPU sampler)."""
    params = SamplingParams(n=4, temperature=1.0, max_tokens=4, seed=9)
    for i in range(8):
        manager.submit(f"wide-{i}", [1] + [40 + (i + j) % 60 for j in range(99)], params)
    groups = _collect(manager)
    assert sorted(g.request_id for g in groups) == sorted(f"wide-{i}" for i in range(8))
    assert manager.health() == [True, True]


def test_max_tokens_truncates_and_stop_tokens_stop(manager):
    manager.submit("long", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5))
    (group,) = _collect(manager)
    sample = group.samples[0]
    assert (len(sample.token_ids), sample.finish_reason, sample.truncated) == (5, "length", True)
    stop = sample.token_ids[2]
    manager.submit("stopped", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=5, stop_token_ids=(stop,)))
    (stopped,) = _collect(manager)
    first_stop = sample.token_ids.index(stop)
    assert stopped.samples[0].token_ids == sample.token_ids[:first_stop + 1]
    assert (stopped.samples[0].finish_reason, stopped.samples[0].truncated) == ("stop", False)


def test_cancel_all_drops_outstanding_work_and_engines_stay_healthy(manager):
    for i in range(6):
        manager.submit(f"cancel-{i}", PROMPTS[i], SamplingParams(n=2, temperature=1.0, max_tokens=400, seed=i))
    assert manager.cancel_all() == 6
    assert manager.finished(timeout=0) == []  # nothing outstanding
    assert _collect(manager) == []
    assert manager.health() == [True, True]


def test_synced_weights_give_transformers_greedy_tokens_and_log_probs_and_tempered_ones(manager, tied_qwen2_dir):
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tied_qwen2_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.05)
    metrics = manager.sync_weights(hf_model.state_dict().items())
    expected_bytes = sum(p.numel() * p.element_size() for p in hf_model.state_dict().values())
    assert metrics["bytes"] == expected_bytes and metrics["buckets"] > 1 and metrics["seconds"] > 0

    for i, prompt in enumerate(PROMPTS[:4]):
        manager.submit(f"synced-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=10))
    max_diff = greedy_log_prob_gap(hf_model, _collect(manager))  # asserts the greedy tokens are transformers' argmax
    print(f"max |engine - transformers| log-prob difference: {max_diff:.2e}")
    assert max_diff < 1e-4

    # Sampled at temperature 0.7, the engine reports the log-probs of the distribution it sampled from,
    # log_softmax(logits / 0.7): what the trainer recomputes (vLLM's default, raw_logprobs, would give T = 1's).
    temperature, tempered_diff, untempered_gap = 0.7, 0.0, 0.0
    for i, prompt in enumerate(PROMPTS[:2]):
        manager.submit(f"tempered-{i}", prompt, SamplingParams(n=2, temperature=temperature, max_tokens=10, seed=i))
    for group in _collect(manager):
        for sample in group.samples:
            tokens = torch.tensor([group.prompt_token_ids + sample.token_ids])
            with torch.no_grad():
                logits = hf_model(tokens).logits[0].float()
            positions = torch.arange(len(group.prompt_token_ids) - 1, tokens.shape[1] - 1)
            rows, generated = logits[positions], torch.tensor(sample.token_ids)
            engine = torch.tensor(sample.logprobs)
            tempered = torch.log_softmax(rows / temperature, dim=-1)[torch.arange(len(generated)), generated]
            untempered = torch.log_softmax(rows, dim=-1)[torch.arange(len(generated)), generated]
            tempered_diff = max(tempered_diff, (tempered - engine).abs().max().item())
            untempered_gap = max(untempered_gap, (untempered - engine).abs().max().item())
    print(f"temperature {temperature}: max |engine - tempered| {tempered_diff:.2e}, vs untempered {untempered_gap:.2e}")
    assert tempered_diff < 1e-4 and untempered_gap > 1e-2



def test_engines_run_at_the_trainers_priority(manager):
    """The engines' processes (Ray actor, vLLM's engine core and worker) run at niceness 0, the private cluster's
    setting: at Ray's default, 15, anything else busy on the machine took their cores."""
    import psutil

    for pid_file in manager.actors.pid_dir.glob("*.pid"):
        actor = psutil.Process(int(pid_file.read_text().split()[1]))
        tree = [actor, *actor.children(recursive=True)]
        assert len(tree) >= 3 and all(process.nice() == 0 for process in tree), [p.name() for p in tree]
