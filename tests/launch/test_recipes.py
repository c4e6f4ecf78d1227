"""Every recipe YAML under examples/ loads through the real config loader and validator with the seeds' settings."""
from pathlib import Path

import pytest

from megatron_cpo.config import load_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(EXAMPLES.glob("qwen*/*.yaml"))
# the model each recipe folder trains and its context length (max_position_embeddings of its config.json on the Hub)
MODELS = {"qwen2.5-math-1.5b": ("Qwen/Qwen2.5-Math-1.5B", 4096), "qwen2.5-math-7b": ("Qwen/Qwen2.5-Math-7B", 4096),
          "qwen3-8b": ("Qwen/Qwen3-8B", 40960), "qwen3-30b-a3b": ("Qwen/Qwen3-30B-A3B", 40960)}


def test_every_size_has_grpo_dapo_and_cpo_and_the_7b_ppo():
    assert {(path.parent.name, path.stem) for path in RECIPES} == {
        (size, algo) for size in MODELS for algo in ("grpo", "dapo", "cpo")} | {("qwen2.5-math-7b", "ppo")}


@pytest.mark.parametrize("path", RECIPES, ids=[f"{p.parent.name}/{p.name}" for p in RECIPES])
def test_recipe_loads_and_validates(path):
    config = load_config(path)
    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    model, context = MODELS[path.parent.name]
    assert config.actor_rollout_ref.model.path == model
    assert config.data.max_prompt_length + config.data.max_response_length <= context, "beyond the model's context"
    assert config.data.train_batch_size % actor.ppo_mini_batch_size == 0
    assert rollout.n >= 2 or not config.algorithm.estimator_needs.grouped  # PPO's critic needs no group
    assert config.trainer.experiment_name == f"{path.parent.name}-{path.stem}"
    if path.stem == "dapo":
        assert actor.clip_ratio_high == 0.28 and actor.loss_agg_mode == "token-mean" and not actor.use_kl_loss
        groups = config.algorithm.filter_groups
        assert groups.enable and groups.metric == "acc" and groups.max_num_gen_batches == 10
    if path.stem == "cpo":
        cpo = config.algorithm.cpo
        assert config.algorithm.adv_estimator == "cpo" and cpo.wrap_method == "negonly_mi3"
        assert (cpo.cpo_lambda, cpo.pos_alpha, cpo.neg_alpha) == (5.0, 0.05, 0.1)
        assert cpo.gold_as_hint and config.algorithm.shaper.needs_hint_contexts
    if path.stem == "grpo":
        assert config.algorithm.adv_estimator == "grpo" and not config.algorithm.filter_groups.enable
    if path.stem == "ppo":
        assert config.algorithm.adv_estimator == "gae" and config.critic_enabled and rollout.n == 1


@pytest.mark.parametrize("path", RECIPES[:1], ids=["override"])
def test_recipe_accepts_dotted_overrides(path):
    config = load_config(path, ["data.train_batch_size=64", "actor_rollout_ref.actor.ppo_mini_batch_size=32"])
    assert config.data.train_batch_size == 64 and config.actor_rollout_ref.actor.ppo_mini_batch_size == 32


def test_the_moe_recipes_split_experts_over_8_ranks_without_an_auxiliary_loss():
    """Qwen3-30B-A3B as slime's and verl's scripts lay it out: EP 8, ETP 1 (slime: TP 4 with sequence parallelism)."""
    for algo in ("grpo", "dapo", "cpo"):
        megatron = load_config(EXAMPLES / "qwen3-30b-a3b" / f"{algo}.yaml").actor_rollout_ref.actor.megatron
        assert (megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size) == (8, 1)
        assert megatron.tensor_model_parallel_size == 4 and megatron.sequence_parallel
        assert megatron.override_transformer_config.moe_aux_loss_coeff == 0


SMOLLM2 = sorted(EXAMPLES.glob("smollm2-135m/*.yaml"))


@pytest.mark.parametrize("path", SMOLLM2, ids=[p.name for p in SMOLLM2])
def test_smollm2_examples_use_the_fast_cpu_settings(path):
    """The real-model example: the dtype the CPU computes fastest (`auto`), token budgets that fit the prompt +
    response, an on-policy update (no separate old-log-prob pass; CPO's shaping reads the update's own forward), CPO's
    hint asking for the sum last; CPO on DAPO is dapo.yaml plus the shaping, CPO on GRPO grpo.yaml plus the same
    shaping."""
    from megatron_cpo.trainer.components import policy_update_config
    from megatron_cpo.trainer.workers.policy_update import old_log_probs_from_update

    config = load_config(path)
    actor, model = config.actor_rollout_ref.actor, config.actor_rollout_ref.model
    assert actor.megatron.params_dtype == "auto" and actor.use_dynamic_bsz and model.use_fused_kernels
    assert actor.ppo_max_token_len_per_gpu >= config.data.max_prompt_length + config.data.max_response_length
    assert old_log_probs_from_update(policy_update_config(config))
    assert "\\boxed" not in config.data.hint_instruction or not path.stem.startswith("cpo")
    assert {p.stem for p in SMOLLM2} == {"grpo", "dapo", "cpo", "cpo_grpo", "grpo_lora_r32", "grpo_lora_r1"}
    if path.stem.startswith("cpo"):  # the CPO files are their base's file plus algorithm.cpo and the hint text
        base = load_config(path.parent / ("dapo.yaml" if path.stem == "cpo" else "grpo.yaml"))
        assert config.algorithm.adv_estimator == "cpo" and config.algorithm.cpo.wrap_method == "negonly_mi3"
        for section in ("actor_rollout_ref", "reward"):
            assert getattr(config, section) == getattr(base, section), section
        assert config.algorithm.filter_groups == base.algorithm.filter_groups
