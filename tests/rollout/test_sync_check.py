"""The sync check's engine side (rollout/sync_check.py): the probe runs beside the controller's requests without
being one of them, the engines' reload reports name a push that missed or repeated a tensor, and the pure parts
(settings, tolerances, the comparison)."""
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch

from megatron_cpo.rollout import SamplingParams, WeightSender
from megatron_cpo.rollout.config import DEFAULT_TOLERANCES, SyncCheckConfig
from megatron_cpo.rollout.sync_check import compare_probe
from megatron_cpo.rollout.weight_sync import reload_problem
from tests.conditions import wait_until

PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90], [1, 33, 3]]


def _unfinished(engine) -> int:
    """Requests the engine actor's vLLM engine holds unfinished now (asked inside the actor)."""
    return ray.get(engine.__ray_call__.remote(lambda actor: actor.engine.get_num_unfinished_requests()), timeout=60)


def test_probe_requests_are_neither_returned_by_finished_nor_aborted_by_cancel_all(manager):
    manager.submit("long", PROMPTS[0], SamplingParams(temperature=1.0, max_tokens=300, seed=3))  # on engine 0
    with ThreadPoolExecutor(1) as pool:
        probe = pool.submit(manager.sync_probe, PROMPTS, 200)
        wait_until(lambda: _unfinished(manager.engines[0]) >= 1 + len(PROMPTS), 120, "the probe to run on engine 0")
        assert manager.cancel_all() == 1
        groups = probe.result(timeout=300)
    assert manager.finished(timeout=30) == [] and not manager._pending  # nothing outstanding
    assert [g.request_id for g in groups] == [f"engine {e}, prompt {p}" for e in (0, 1) for p in range(len(PROMPTS))]
    assert all(len(g.samples[0].token_ids) == 200 for g in groups), "a probe request was cut short"
    for prompt in range(len(PROMPTS)):  # both engines serve the same weights: same greedy tokens, same log-probs
        first, second = groups[prompt].samples[0], groups[len(PROMPTS) + prompt].samples[0]
        assert first.token_ids == second.token_ids
        assert max(abs(a - b) for a, b in zip(first.logprobs, second.logprobs)) < 1e-5

    manager.submit("short", PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(manager.sync_probe(PROMPTS[:1], 4)) == 2
    assert [g.request_id for g in manager.finished(timeout=300)] == ["short"]


def test_the_engines_report_a_push_that_missed_or_repeated_a_tensor(manager, tied_qwen2_dir):
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(tied_qwen2_dir, dtype=torch.float32).state_dict()
    repeated = "model.layers.0.input_layernorm.weight"  # a CPU linear layer would refuse it loudly instead
    pushed = [(name, t) for name, t in state.items() if name != "model.norm.weight"] + [(repeated, state[repeated])]
    manager.begin_weight_sync()
    try:
        WeightSender(manager.sender_spec("shm"), engine_handles=manager.engines).send(pushed)
    finally:
        reports = manager.finish_weight_sync()
    assert set(reports) == {"engine 0", "engine 1"}
    for (report,) in reports.values():  # one worker per engine
        assert report == {"tensors": len(pushed), "missing": ["model.norm.weight"], "repeated": [repeated],
                          "prefix_cache_reset": True}
    assert reload_problem(reports).startswith("rollout engine 0 received nothing for 1 weight(s) in this push: "
                                              "['model.norm.weight']")
    assert "received more than once" in reload_problem({"engine 0": [{**report, "missing": []}]})
    assert "kept its prefix cache" in reload_problem({"engine 0": [{"prefix_cache_reset": False}]})
    manager.sync_weights(state.items())  # the shared engines serve the model again


def test_settings_are_checked_and_the_tolerance_follows_the_dtype():
    assert SyncCheckConfig().tolerance_for("float32") == DEFAULT_TOLERANCES["float32"]
    assert SyncCheckConfig().tolerance_for("bfloat16") == DEFAULT_TOLERANCES["bfloat16"]
    assert SyncCheckConfig(tolerance=0.02).tolerance_for("bfloat16") == 0.02
    assert [SyncCheckConfig(every_n_pushes=3).due(push) for push in range(5)] == [True, False, False, True, False]
    assert not SyncCheckConfig(enable=False).due(0)
    with pytest.raises(ValueError, match=r"sync_check.every_n_pushes=0 must be >= 1"):
        SyncCheckConfig(every_n_pushes=0)
    with pytest.raises(ValueError, match=r"sync_check.prompts is empty"):
        SyncCheckConfig(prompts=[" "])
    with pytest.raises(ValueError, match=r"sync_check.tolerance=-1 must be >= 0"):
        SyncCheckConfig(tolerance=-1)


def test_the_comparison_finds_the_worst_token_and_fails_on_nan():
    trainer = torch.tensor([[-1.0, -2.0, 5.0], [-0.5, -0.25, -4.0]])  # 5.0: padding beyond row 0's two tokens
    gap = compare_probe(["engine 0, prompt 0", "engine 1, prompt 0"], [[-1.0, -2.001], [-0.5, -0.75, -4.0]], trainer)
    assert gap.max_abs_diff == pytest.approx(0.5) and gap.worst == "engine 1, prompt 0, token 1"
    assert gap.mean_abs_diff == pytest.approx(0.501 / 5)
    assert gap.metrics() == {"rollout/sync_check_max_abs_diff": gap.max_abs_diff,
                             "rollout/sync_check_mean_abs_diff": gap.mean_abs_diff}
    nan = compare_probe(["engine 0, prompt 0"], [[float("nan")]], torch.zeros(1, 2))
    assert nan.max_abs_diff == float("inf") and nan.trainer_non_finite is None  # the engine's fault


def test_the_comparison_tells_the_trainers_own_non_finite_log_probs_from_an_engine_out_of_sync():
    """Non-finite trainer log-probs mean non-finite trainer weights (the engines were sent them); padding beyond a
    row's tokens is not looked at."""
    trainer = torch.tensor([[-1.0, float("nan")], [-0.5, float("-inf")]])
    gap = compare_probe(["engine 0, prompt 0", "engine 0, prompt 1"], [[-1.0], [-0.5, float("nan")]], trainer)
    assert gap.trainer_non_finite == "-inf at engine 0, prompt 1, token 1" and gap.max_abs_diff == float("inf")
    assert compare_probe(["engine 0, prompt 0"], [[-1.0]], trainer[:1]).trainer_non_finite is None
