"""A frozen Megatron teacher (`kind: megatron`) scores the same at TP=2 and at PP=2 as at TP=1 (real Megatron-Core
over gloo, two spawned ranks, one spawn for every layout): the sampled tokens' log-probs, its top-k ids and their
log-probs, from the hidden states and the vocab-parallel lm-head; a teacher whose `load` names a Megatron checkpoint
scores with those weights, not the Hugging Face ones; and the self teacher (the actor's own model) scores as a
frozen teacher of the same weights does."""
import numpy as np
import torch

from tests.multiprocess import run_processes

PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90, 91], [1, 33, 3], [1, 100, 101], [1, 7]]
RESPONSES = [[50, 51, 52, 53, 54, 55], [7, 8], [90, 91, 92, 93, 94, 95, 96, 97, 98], [], [5, 6, 7]]
TOPK = 4
LAYOUTS = ((1, 1), (2, 1), (1, 2))


def _as_numpy(scores) -> dict:
    return {"log_probs": scores.log_probs.numpy(), "ids": scores.topk_ids.numpy(), "top": scores.topk_log_probs.numpy()}


def _ranks(rank: int, world_size: int, model_dir: str, checkpoint_dir: str) -> dict:
    from megatron.core import parallel_state

    from megatron_cpo import platform
    from megatron_cpo.models.checkpoint import save_checkpoint
    from megatron_cpo.rollout.teacher_config import TeacherModelConfig
    from megatron_cpo.trainer.config import ActorConfig
    from megatron_cpo.trainer.workers.megatron_teacher import build_megatron_teacher, self_teacher

    torch.set_num_threads(1)
    actor = ActorConfig()
    out = {}
    for tp, pp in LAYOUTS:
        actor.megatron.tensor_model_parallel_size, actor.megatron.pipeline_model_parallel_size = tp, pp
        platform.init_distributed(tp, pp, seed=0)
        teacher = build_megatron_teacher("hf", TeacherModelConfig(model_path=model_dir, kind="megatron"), actor, 0,
                                         TOPK)
        out[f"tp{tp}-pp{pp}"] = _as_numpy(teacher.score(PROMPTS, RESPONSES))
        if (tp, pp) == (1, 1):  # weights of its own in a Megatron checkpoint, and the same model as a self teacher
            with torch.no_grad():
                for param in teacher.model.parameters():
                    param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(3)) * 0.05)
            save_checkpoint(teacher.model, checkpoint_dir)
            out["perturbed"] = _as_numpy(self_teacher(teacher.model, actor, 0, TOPK).score(PROMPTS, RESPONSES))
        if (tp, pp) == (2, 1):
            loaded = build_megatron_teacher("ckpt", TeacherModelConfig(model_path=model_dir, kind="megatron",
                                                                       load=checkpoint_dir), actor, 0, TOPK)
            out["loaded"] = _as_numpy(loaded.score(PROMPTS, RESPONSES))
        # one default group for every layout: re-creating it on the same port races (a rank that gets there first
        # joins the other's old store and is refused)
        parallel_state.destroy_model_parallel()
    platform.destroy_distributed()
    return out


def test_a_megatron_teacher_scores_alike_at_every_layout_and_from_its_checkpoint(tied_qwen2_dir, tmp_path):
    ranks = run_processes(_ranks, 2, str(tied_qwen2_dir), str(tmp_path / "teacher_ckpt"))
    for rank in ranks:  # every rank holds the whole batch's scores
        for key in rank:
            np.testing.assert_array_equal(rank[key]["ids"], ranks[0][key]["ids"])
    scores = ranks[0]
    lengths = np.array([len(r) for r in RESPONSES])
    valid = np.arange(9)[None, :] < lengths[:, None]
    reference = scores["tp1-pp1"]
    assert reference["log_probs"].shape == (5, 9) and reference["ids"].shape == (5, 9, TOPK)
    assert not reference["log_probs"][~valid].any() and (reference["log_probs"][valid] < 0).all()
    for layout in ("tp2-pp1", "tp1-pp2"):
        for name in ("log_probs", "top"):
            np.testing.assert_allclose(scores[layout][name][valid], reference[name][valid], rtol=0, atol=2e-5,
                                       err_msg=f"{layout} {name}")
        np.testing.assert_array_equal(scores[layout]["ids"][valid], reference["ids"][valid], err_msg=layout)
    # the checkpoint's weights (saved at TP=1 x DP=2, loaded at TP=2), not the Hugging Face ones
    np.testing.assert_allclose(scores["loaded"]["log_probs"][valid], scores["perturbed"]["log_probs"][valid], rtol=0,
                               atol=2e-5)
    assert np.abs(scores["loaded"]["log_probs"][valid] - reference["log_probs"][valid]).max() > 1e-3
