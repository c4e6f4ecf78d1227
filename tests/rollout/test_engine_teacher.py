"""Distillation teachers on the shared engines: an engine teacher (vLLM prompt log-probs of `prompt + response`, top-k
included) equals a Megatron teacher holding the same weights to float32 noise; groups scored as they are submitted
come back by id, empty responses included; two teachers routed by key each score their rows; a non-finite teacher
log-prob is refused naming the response.

The engines first take the Megatron model's weights (a push), so the comparison holds whatever earlier tests pushed.
"""
import os

import pytest
import torch

from megatron_cpo.rollout.engine_teacher import EngineTeacher
from megatron_cpo.rollout.teachers import TeacherRouter, TeacherScoreError, TeacherScores

TOPK = 5
PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90, 91], [1, 33, 3], [1, 100, 101]]
RESPONSES = [[50, 51, 52, 53, 54, 55], [7, 8], [90, 91, 92, 93, 94, 95, 96, 97, 98], []]
TOLERANCE = 1e-4  # float32 engines and Megatron: different kernels, same weights


@pytest.fixture
def megatron_teacher(manager, tied_qwen2_dir):
    """The tied tiny Qwen2 as a Megatron teacher in this process (TP=1), its weights pushed into the engines."""
    from megatron_cpo import platform
    from megatron_cpo.models import build_gpt_model, iter_hf_weights, load_hf_config, load_hf_weights
    from megatron_cpo.trainer.config import ActorConfig
    from megatron_cpo.trainer.workers.megatron_teacher import MegatronTeacher

    saved_environment = dict(os.environ)
    platform.init_distributed(seed=0)
    try:
        hf_config = load_hf_config(tied_qwen2_dir)
        model = build_gpt_model(hf_config)
        load_hf_weights(model, tied_qwen2_dir)
        with torch.no_grad():  # weights of their own, so the engines cannot pass by serving the file's
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.02)
        manager.sync_weights(iter_hf_weights(model, hf_config))
        yield MegatronTeacher(model, 0, ActorConfig(), TOPK, "megatron")
    finally:
        platform.destroy_distributed()
        os.environ.clear()
        os.environ.update(saved_environment)


def test_an_engine_teacher_equals_a_megatron_teacher_on_the_same_weights(manager, megatron_teacher):
    engines = EngineTeacher("engines", manager, TOPK, owns_engines=False)
    served, computed = engines.score(PROMPTS, RESPONSES), megatron_teacher.score(PROMPTS, RESPONSES)
    lengths = torch.tensor([len(r) for r in RESPONSES])
    valid = torch.arange(served.log_probs.shape[1])[None, :] < lengths[:, None]
    assert served.log_probs.shape == computed.log_probs.shape == (4, 9)
    assert served.topk_ids.shape == computed.topk_ids.shape == (4, 9, TOPK)
    gap = float((served.log_probs - computed.log_probs)[valid].abs().max())
    top_gap = float((served.topk_log_probs - computed.topk_log_probs)[valid].abs().max())
    print(f"|engine - Megatron| sampled tokens {gap:.1e}, top-{TOPK} {top_gap:.1e}")
    assert gap < TOLERANCE and top_gap < TOLERANCE
    assert bool((served.log_probs[~valid] == 0).all()) and bool((served.topk_ids[~valid] == 0).all())
    # the same ids wherever the top-k are not tied within the noise
    separated = (computed.topk_log_probs[..., :-1] - computed.topk_log_probs[..., 1:] > 10 * TOLERANCE).all(-1)
    assert int((valid & separated).sum()) > 10
    assert torch.equal(served.topk_ids[valid & separated], computed.topk_ids[valid & separated])
    # best first, and the sampled token's log-prob never above the best
    assert bool((served.topk_log_probs[valid][:, :-1] >= served.topk_log_probs[valid][:, 1:]).all())
    assert bool((served.log_probs[valid] <= served.topk_log_probs[valid][:, 0] + 1e-6).all())


def test_groups_scored_as_they_finish_come_back_by_id(manager):
    sampled = EngineTeacher("sampled", manager, topk=0, owns_engines=False)
    whole = sampled.score(PROMPTS[:2] + PROMPTS[:2], RESPONSES[:2] + [RESPONSES[2], []])
    sampled.submit("group-a", PROMPTS[0], [RESPONSES[0], RESPONSES[2]])
    sampled.submit("group-b", PROMPTS[1], [RESPONSES[1], []])
    groups = sampled.collect(["group-b", "group-a"], timeout=300)
    assert set(groups) == {"group-a", "group-b"} and groups["group-a"].topk_ids is None
    a, b = groups["group-a"].log_probs, groups["group-b"].log_probs
    assert a.shape == (2, 9) and b.shape == (2, 2) and not b[1].any()
    torch.testing.assert_close(a[0, :6], whole.log_probs[0, :6], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(a[1], whole.log_probs[2], rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(b[0], whole.log_probs[1, :2], rtol=0, atol=TOLERANCE)
    assert manager.finished(timeout=0) == []  # scoring never shows up as generation


def test_teachers_routed_by_key_score_their_rows(manager):
    first, second = (EngineTeacher(name, manager, topk=2, owns_engines=False) for name in ("first", "second"))
    router = TeacherRouter({"openai/gsm8k": first, "math": second})
    routed = router.score(PROMPTS[:3], RESPONSES[:3], ["math", "openai/gsm8k", "math"], width=10)
    direct = first.score(PROMPTS[:3], RESPONSES[:3])
    assert routed.log_probs.shape == (3, 10) and routed.topk_ids.shape == (3, 10, 2)
    torch.testing.assert_close(routed.log_probs[:, :9], direct.log_probs, rtol=0, atol=TOLERANCE)
    with pytest.raises(KeyError, match="no teacher scores rows whose teacher key is 'code'"):
        router.score(PROMPTS[:1], RESPONSES[:1], ["code"], width=10)


def test_a_non_finite_teacher_log_prob_is_refused_naming_the_response():
    scores = TeacherScores.from_rows([([-0.5, float("nan")], None, None), ([-1.0], None, None)], width=3, topk=0)
    scores.check_finite([1, 1], ["uid-0/sample0", "uid-0/sample1"], "gsm8k")  # the NaN lies past the first's end
    with pytest.raises(TeacherScoreError, match="teacher 'gsm8k' gave a non-finite log-prob \\(nan\\) to token 1 of "
                                                "response 'uid-0/sample0'"):
        scores.check_finite([2, 1], ["uid-0/sample0", "uid-0/sample1"], "gsm8k")
    top = TeacherScores.from_rows([([-0.5], [[3, 4]], [[-0.1, float("-inf")]])], width=1, topk=2)
    with pytest.raises(TeacherScoreError, match="\\(-inf\\) to token 0 of response 'r'"):
        top.check_finite([1], ["r"], "t")
