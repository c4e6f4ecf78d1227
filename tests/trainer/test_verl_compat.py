"""verl launch scripts load: eight real scripts' overrides (tests/fixtures/verl_overrides/) against shipped recipes,
every problem of a command reported at once with right hints, and no key that changes the algorithm ignored; verl's
PPO scripts (GAE with a Megatron critic) and its GSPO script (Qwen3-30B-A3B with experts) pass
`megatron-cpo train --dry-run`."""
import json
import shutil
from pathlib import Path

import pytest

from megatron_cpo.config import Config, ConfigError, build_config, known_names, load_config, resolve_config

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "verl_overrides"
EXAMPLES = ROOT / "examples"
RECIPES = EXAMPLES / "qwen2.5-math-7b"

# Keys accepted without effect, per script (hand-listed from verl_compat.py's reasons: none changes the maths).
EXPECTED_IGNORED = {
    "grpo_qwen2_7b_math_megatron.txt": {
        "data.return_raw_chat", "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"},
    "dapo_qwen2.5_7b_math_megatron.txt": {
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.ref.megatron.param_offload",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size", "reward_model.reward_manager",
        "reward_model.reward_kwargs.max_resp_len", "trainer.log_val_generations"},
    "dapo_qwen2.5_32b.txt": {
        "actor_rollout_ref.ref.log_prob_use_dynamic_bsz", "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor_rollout_ref.actor.fsdp_config.fsdp_size",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size", "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.ref.fsdp_config.param_offload", "actor_rollout_ref.ref.ulysses_sequence_parallel_size",
        "reward_model.reward_manager"},
    "gpg_qwen2_7b_math_megatron.txt": {
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"},
    "reinforce_plus_plus_qwen2_7b_math.txt": {
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.actor.fsdp_config.param_offload",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload", "actor_rollout_ref.ref.fsdp_config.param_offload"},
    "ppo_qwen2_7b_math_megatron.txt": {
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"},
    "ppo_deepseek_llm_7b_math_megatron.txt": {
        "actor_rollout_ref.rollout.name", "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size"},
    "gspo_qwen30b_a3b_ep.txt": {
        "data.return_raw_chat", "actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.calculate_log_probs",
        "actor_rollout_ref.rollout.data_parallel_size", "actor_rollout_ref.rollout.expert_parallel_size",
        "actor_rollout_ref.ref.megatron.param_offload", "actor_rollout_ref.actor.megatron.use_mbridge",
        *(f"actor_rollout_ref.actor.megatron.override_transformer_config.{key}"
          for key in ("apply_rope_fusion", "gradient_accumulation_fusion", "moe_permute_fusion")),
        "reward_model.reward_manager", "trainer.log_val_generations", "actor_rollout_ref.ref.log_prob_use_dynamic_bsz",
        "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu",
        *(f"actor_rollout_ref.ref.megatron.{key}" for key in ("pipeline_model_parallel_size",
                                                              "tensor_model_parallel_size",
                                                              "expert_model_parallel_size",
                                                              "expert_tensor_parallel_size")),
        "reward_model.reward_kwargs.max_resp_len"},
}
RECIPE_OF = {"grpo_qwen2_7b_math_megatron.txt": "qwen2.5-math-7b/grpo.yaml",
             "dapo_qwen2.5_7b_math_megatron.txt": "qwen2.5-math-7b/dapo.yaml",
             "dapo_qwen2.5_32b.txt": "qwen2.5-math-7b/dapo.yaml",
             "gpg_qwen2_7b_math_megatron.txt": "qwen2.5-math-7b/grpo.yaml",
             "reinforce_plus_plus_qwen2_7b_math.txt": "qwen2.5-math-7b/grpo.yaml",
             "ppo_qwen2_7b_math_megatron.txt": "qwen2.5-math-7b/ppo.yaml",
             "ppo_deepseek_llm_7b_math_megatron.txt": "qwen2.5-math-7b/ppo.yaml",
             "gspo_qwen30b_a3b_ep.txt": "qwen3-30b-a3b/grpo.yaml"}


def overrides_of(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines() if line and not line.startswith("#")]


def distinct_keys(overrides: list[str]) -> set[str]:
    return {line.split("=", 1)[0].lstrip("+") for line in overrides}


def test_fixtures_hold_the_eight_scripts():
    sizes = {name: len(distinct_keys(overrides_of(name))) for name in EXPECTED_IGNORED}
    assert sizes == {"grpo_qwen2_7b_math_megatron.txt": 39, "dapo_qwen2.5_7b_math_megatron.txt": 66,
                     "dapo_qwen2.5_32b.txt": 70, "gpg_qwen2_7b_math_megatron.txt": 37,
                     "reinforce_plus_plus_qwen2_7b_math.txt": 37, "ppo_qwen2_7b_math_megatron.txt": 34,
                     "ppo_deepseek_llm_7b_math_megatron.txt": 34, "gspo_qwen30b_a3b_ep.txt": 88}


@pytest.mark.parametrize("name", sorted(EXPECTED_IGNORED))
def test_verl_script_loads_whole_against_a_shipped_recipe(name):
    overrides = overrides_of(name)
    resolved = resolve_config(EXAMPLES / RECIPE_OF[name], overrides)
    assert set(resolved.ignored) == EXPECTED_IGNORED[name]
    keys = distinct_keys(overrides)
    honoured = keys - set(resolved.ignored)
    assert len(honoured) / len(keys) >= 0.75, sorted(resolved.ignored)
    warning = resolved.ignored_warning()
    assert warning.startswith(f"{len(EXPECTED_IGNORED[name])} verl setting(s) accepted but not used here")
    assert "actor_rollout_ref.rollout.name='vllm' (rollouts always run on vLLM)" in warning


@pytest.mark.parametrize("name", sorted(EXPECTED_IGNORED))
def test_at_least_90_percent_of_the_keys_load_one_at_a_time(name):
    """The issue's measurement: each override alone against the recipe."""
    recipe = EXAMPLES / RECIPE_OF[name]
    failed = []
    for override in overrides_of(name):
        try:
            resolve_config(recipe, [override])
        except ConfigError as err:
            failed.append(str(err))
    keys = distinct_keys(overrides_of(name))
    assert (len(keys) - len(failed)) / len(keys) >= 0.9, failed


def test_the_docs_count_every_script():
    """docs/verl_compat.md's counts are the fixtures': distinct keys, honoured or checked, accepted without effect,
    and overrides that load one at a time, in the order of its list of scripts."""
    names = ["grpo_qwen2_7b_math_megatron.txt", "dapo_qwen2.5_7b_math_megatron.txt", "dapo_qwen2.5_32b.txt",
             "gpg_qwen2_7b_math_megatron.txt", "reinforce_plus_plus_qwen2_7b_math.txt",
             "ppo_qwen2_7b_math_megatron.txt", "ppo_deepseek_llm_7b_math_megatron.txt", "gspo_qwen30b_a3b_ep.txt"]
    assert sorted(names) == sorted(EXPECTED_IGNORED)
    keys = [len(distinct_keys(overrides_of(name))) for name in names]
    ignored = [len(EXPECTED_IGNORED[name]) for name in names]
    alone = []
    for name in names:
        loaded = 0
        for override in overrides_of(name):
            try:
                resolve_config(EXAMPLES / RECIPE_OF[name], [override])
                loaded += 1
            except ConfigError:
                pass
        alone.append(loaded)

    def listed(counts):
        return ", ".join(map(str, counts[:-1])) + f" and {counts[-1]}"

    text = " ".join((ROOT / "docs" / "verl_compat.md").read_text().split())
    assert "Tested on eight real scripts" in text
    assert (f"({listed(keys)} keys; {listed([k - i for k, i in zip(keys, ignored)])} of them are honoured or checked, "
            f"and {listed(ignored)} accepted without effect). One at a time, {listed(alone)} load") in text


def test_the_scripts_values_reach_the_config():
    grpo = resolve_config(RECIPES / "grpo.yaml", overrides_of("grpo_qwen2_7b_math_megatron.txt")).config
    assert grpo.data.train_files == ["/home/user/data/gsm8k/train.parquet", "/home/user/data/math/train.parquet"]
    assert (grpo.data.filter_overlong_prompts, grpo.data.truncation) == (True, "error")
    assert grpo.actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu == 4
    assert grpo.actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu == 4
    assert grpo.actor_rollout_ref.rollout.gpu_memory_utilization == 0.6
    assert (grpo.trainer.n_gpus_per_node, grpo.trainer.nnodes) == (8, 1)
    assert grpo.trainer.logger == ["console", "wandb"] and grpo.algorithm.use_kl_in_reward is False

    dapo = resolve_config(RECIPES / "dapo.yaml", overrides_of("dapo_qwen2.5_32b.txt")).config
    rollout = dapo.actor_rollout_ref.rollout
    assert dapo.data.gen_batch_size == 1536 and dapo.data.truncation == "left" and dapo.data.prompt_key == "prompt"
    assert dapo.actor_rollout_ref.actor.optim.clip_grad == 1.0  # verl's actor.grad_clip moved to optim.clip_grad
    assert (rollout.enable_chunked_prefill, rollout.max_num_batched_tokens) == (True, 2048 + 20480)
    val = rollout.val_kwargs
    assert (val.do_sample, val.temperature, val.top_p, val.top_k, val.n) == (True, 1.0, 0.7, -1, 1)
    assert dapo.algorithm.kl_ctrl.kl_coef == 0.0 and dapo.algorithm.filter_groups.max_num_gen_batches == 10
    overlong = dapo.reward.overlong_buffer
    assert (overlong.enable, overlong.len, overlong.penalty_factor) == (True, 4096, 1.0)

    dapo7 = resolve_config(RECIPES / "dapo.yaml", overrides_of("dapo_qwen2.5_7b_math_megatron.txt")).config
    overlong = dapo7.reward.overlong_buffer  # from +reward_model.reward_kwargs.overlong_buffer_cfg.*
    assert (overlong.enable, overlong.len, overlong.log) == (True, 4096, False)
    assert dapo7.trainer.resume == "auto" and dapo7.trainer.val_before_train is False


def test_the_algorithm_scripts_select_their_estimator_and_loss():
    """verl's GPG (estimator and loss) and REINFORCE++ (with KL in the reward) scripts run those algorithms here."""
    gpg = resolve_config(RECIPES / "grpo.yaml", overrides_of("gpg_qwen2_7b_math_megatron.txt")).config
    assert (gpg.algorithm.adv_estimator, gpg.actor_rollout_ref.actor.policy_loss.loss_mode) == ("gpg", "gpg")
    assert gpg.algorithm.estimator_needs.grouped
    rf = resolve_config(RECIPES / "grpo.yaml", overrides_of("reinforce_plus_plus_qwen2_7b_math.txt")).config
    assert rf.algorithm.adv_estimator == "reinforce_plus_plus" and rf.algorithm.use_kl_in_reward
    assert not rf.algorithm.estimator_needs.grouped and rf.needs_reference_model


# The real models' config.json values the layout checks read (heads, layers), on the Hub.
PPO_MODELS = {"ppo_qwen2_7b_math_megatron.txt": dict(num_attention_heads=28, num_key_value_heads=4,
                                                     num_hidden_layers=28),
              "ppo_deepseek_llm_7b_math_megatron.txt": dict(num_attention_heads=32, num_key_value_heads=32,
                                                            num_hidden_layers=30)}


def test_the_ppo_scripts_train_a_critic_of_their_settings():
    for name in PPO_MODELS:
        config = resolve_config(RECIPES / "ppo.yaml", overrides_of(name)).config
        critic = config.critic
        assert config.algorithm.adv_estimator == "gae" and config.critic_enabled
        assert critic.model.path == config.actor_rollout_ref.model.path and critic.optim.lr == 1e-5
        assert (critic.ppo_micro_batch_size_per_gpu, critic.ppo_mini_batch_size) == (4, 256)  # mini: the actor's
        assert config.trainer.critic_warmup == 0


@pytest.mark.parametrize("name", sorted(PPO_MODELS))
def test_the_ppo_scripts_pass_the_dry_run(name, tmp_path, capsys, monkeypatch):
    """verl's PPO scripts as they are but for the paths (the data: this test's rows; the model of the actor and of
    the critic: a stand-in folder with the real model's heads and layers and tiny weights) and the logger (wandb is
    not installed here), on the script's 1 node x 8 GPUs at its TP 2 x PP 2."""
    from megatron_cpo.cli import main
    from tests.trainer.test_preflight import TINY_MODEL, _row, write_rows

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    hf = json.loads((model / "config.json").read_text())
    hf.pop("layer_types", None)  # transformers derives it from num_hidden_layers
    hf.update(PPO_MODELS[name])
    (model / "config.json").write_text(json.dumps(hf))
    data = write_rows(tmp_path / "train.parquet", [_row(), _row(truth="5")])
    main(["train", "--config", str(RECIPES / "ppo.yaml"), "--dry-run", *overrides_of(name),
          f"data.train_files={data}", f"data.val_files={data}", f"actor_rollout_ref.model.path={model}",
          f"critic.model.path={model}", f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]"])
    out = capsys.readouterr().out
    assert "nothing was started" in out and "  adv_estimator: gae" in out
    assert "# trainer: 8 process(es)" in out and "TP 2 x PP 2 x DP 2" in out
    assert "a critic (value model) beside the actor, in the same layout" in out
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"


def test_the_gspo_script_passes_the_dry_run_and_says_how_it_aggregates(tmp_path, capsys, monkeypatch):
    """verl's GSPO script for Qwen3-30B-A3B as it is but for the paths (the data: this test's rows; the model: a
    stand-in folder with Qwen3-30B-A3B's heads, layers and experts and tiny weights) and the logger, on its 2 nodes x
    8 GPUs at TP 4 x EP 4: its `loss_agg_mode=token-mean` (which verl's GSPO ignores), `use_mbridge` and vLLM's
    data and expert parallelism load, and the dry run says which aggregation the policy loss computes."""
    from megatron_cpo.cli import main
    from tests.trainer.test_preflight import STAND_IN_DIMENSIONS, TINY_MODEL, _row, write_rows

    name = "gspo_qwen30b_a3b_ep.txt"
    actor = resolve_config(EXAMPLES / RECIPE_OF[name], overrides_of(name)).config.actor_rollout_ref.actor
    assert (actor.policy_loss.loss_mode, actor.loss_agg_mode, actor.policy_aggregation) == (
        "gspo", "token-mean", "seq-mean-token-mean")
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.megatron.expert_model_parallel_size) == (3e-4, 4e-4, 4)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = tmp_path / "model"
    shutil.copytree(TINY_MODEL, model)
    hf = json.loads((model / "config.json").read_text())
    hf.pop("layer_types", None)  # transformers derives it from num_hidden_layers
    hf.update(STAND_IN_DIMENSIONS["qwen3-30b-a3b"])
    (model / "config.json").write_text(json.dumps(hf))
    data = write_rows(tmp_path / "train.parquet", [_row(), _row(truth="5")])
    main(["train", "--config", str(EXAMPLES / RECIPE_OF[name]), "--dry-run", *overrides_of(name),
          f"data.train_files={data}", f"data.val_files={data}", f"actor_rollout_ref.model.path={model}",
          f"trainer.default_local_dir={tmp_path / 'run'}", "trainer.logger=[console]"])
    out = capsys.readouterr().out
    assert "nothing was started" in out and "  loss_mode: gspo" in out
    assert "TP 4 x PP 1 x DP 4; experts: EP 4 x ETP 1 x expert-DP 4" in out
    assert ("# policy_loss.loss_mode=gspo aggregates its policy-gradient term with seq-mean-token-mean, as verl does "
            "whatever loss_agg_mode says; the entropy and KL-loss terms use "
            "actor_rollout_ref.actor.loss_agg_mode=token-mean") in out
    assert "actor_rollout_ref.actor.megatron.use_mbridge=True (verl's choice of weight converter" in out
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"


@pytest.mark.parametrize("override, expected", [
    ("algorithm.cpo.base_estimator=reinforce_plus_plus", "algorithm.cpo.base_estimator='reinforce_plus_plus' cannot "
                                                         "carry CPO's shaping"),
    ("algorithm.rollout_correction.bypass_mode=true", "bypass mode (the engine's as the old ones) is not built"),
    ("algorithm.rollout_correction.rollout_is_batch_normalize=true", "importance weights are not normalised"),
    ("algorithm.rollout_correction.loss_type=reinforce", "use 'ppo_clip' or remove it"),
])
def test_what_is_not_built_is_refused_with_the_reason(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPES / "grpo.yaml", [override])
    assert expected in str(err.value)


def test_custom_reward_function_keys_load():
    """verl's custom_reward_function.path / .name load, as aliases of the reward section's keys."""
    config = build_config({"custom_reward_function": {"path": "reward.py", "name": "score"}})
    assert config.reward.reward_function == "reward.py:score"
    assert "custom_reward_function.path" not in known_names(Config)  # one owner: reward.custom_reward_function


@pytest.mark.parametrize("override, expected", [
    ("trainer.critic_warmup=5", "trainer.critic_warmup=5 trains only a critic in the first steps, and "
                                "algorithm.adv_estimator=grpo has none; set it to 0 (or use gae)"),
    ("actor_rollout_ref.rollout.name=sglang", "use 'vllm' or remove it"),
    ("reward_model.reward_manager=prime", "use 'naive' or 'dapo' or remove it"),
    ("algorithm.kl_ctrl.type=adaptive", "set algorithm.kl_ctrl.type=fixed"),
    ("actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
     "differs from actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4: the reference runs in the actor"),
    ("reward_model.reward_kwargs.max_resp_len=8192", "differs from data.max_response_length=3072"),
])
def test_keys_that_would_change_the_algorithm_are_refused(override, expected):
    with pytest.raises(ConfigError) as err:
        load_config(RECIPES / "dapo.yaml", [override])
    assert expected in str(err.value)


def test_every_problem_of_a_command_is_reported_at_once():
    with pytest.raises(ConfigError) as err:
        build_config({}, ["trainer.n_gpu_per_node=8", "actor_rollout_ref.actor.optim.grad_clip=1.0",
                          "data.train_batch_size=eight", "algorithm.adv_estimator=ppo",
                          "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.actor.optim.betas=[0.9]"])
    message = str(err.value)
    assert message.startswith("6 problems in the config (names and types: docs/config_reference.md):")
    for line in ("unknown config key 'trainer.n_gpu_per_node'; did you mean 'trainer.n_gpus_per_node'?",
                 "unknown config key 'actor_rollout_ref.actor.optim.grad_clip'; did you mean "
                 "'actor_rollout_ref.actor.optim.clip_grad'?",
                 "data.train_batch_size='eight' is not a valid int",
                 "algorithm.adv_estimator='ppo' is not supported",
                 "actor_rollout_ref.rollout.name='sglang' cannot be honoured",
                 "actor_rollout_ref.actor.optim.betas=[0.9] must hold 2 values"):
        assert line in message


@pytest.mark.parametrize("key, hint", [
    ("actor_rollout_ref.actor.lr", "actor_rollout_ref.actor.optim.lr"),
    ("actor_rollout_ref.rollout.tensor_parallel_size", "actor_rollout_ref.rollout.tensor_model_parallel_size"),
    ("optim.betas", "actor_rollout_ref.actor.optim.betas"),
    ("rollout.n", "actor_rollout_ref.rollout.n"),
    ("actor_rollout_ref.actor.optim.grad_clip", "actor_rollout_ref.actor.optim.clip_grad"),
    ("actor.grad_clip", "actor_rollout_ref.actor.optim.clip_grad"),  # a verl alias, written without its prefix
    ("n_gpus_per_node", "trainer.n_gpus_per_node"),
    ("trainer.total_epoch", "trainer.total_epochs"),
    ("data.val_file", "data.val_files"),
])
def test_hints_match_the_last_path_components_first(key, hint):
    with pytest.raises(ConfigError) as err:
        build_config({}, [f"{key}=1"])
    assert f"did you mean {hint!r}?" in str(err.value)


def test_a_key_with_no_close_name_points_to_the_reference_page():
    with pytest.raises(ConfigError, match="see docs/config_reference.md for the accepted names"):
        build_config({}, ["trainer.wandb_proxy=http://x"])


def test_the_megatron_keys_of_verls_qwen3_moe_script_load_against_the_moe_recipe():
    """verl's examples/grpo_trainer/run_qwen3moe-30b_megatron_96gb.sh: its layout and MoE keys, the reference's
    layout repeated; the fusions are accepted without effect; DeepEP's flex dispatcher is refused with the fix."""
    moe = "actor_rollout_ref.actor.megatron.override_transformer_config."
    overrides = [
        "actor_rollout_ref.actor.megatron.expert_model_parallel_size=8",
        "actor_rollout_ref.actor.megatron.expert_tensor_parallel_size=1",
        "actor_rollout_ref.ref.megatron.expert_model_parallel_size=8",
        "actor_rollout_ref.ref.megatron.expert_tensor_parallel_size=1",
        *(f"+{moe}{key}=True" for key in ("apply_rope_fusion", "masked_softmax_fusion", "bias_activation_fusion",
                                          "bias_dropout_fusion", "gradient_accumulation_fusion",
                                          "deallocate_pipeline_outputs", "persist_layer_norm", "moe_grouped_gemm",
                                          "moe_permute_fusion")),
        f"+{moe}moe_router_dtype=fp32"]
    resolved = resolve_config(ROOT / "examples" / "qwen3-30b-a3b" / "grpo.yaml", overrides)
    megatron = resolved.config.actor_rollout_ref.actor.megatron
    assert (megatron.expert_model_parallel_size, megatron.expert_tensor_parallel_size) == (8, 1)
    assert megatron.override_transformer_config.moe_router_dtype == "fp32"
    assert len(resolved.ignored) == 11  # 9 fusions, the reference's EP and ETP repeated
    with pytest.raises(ConfigError, match="moe_token_dispatcher_type='flex' is not supported; choose one of "
                                          "'alltoall', 'allgather'"):
        resolve_config(ROOT / "examples" / "qwen3-30b-a3b" / "grpo.yaml", [f"+{moe}moe_token_dispatcher_type=flex"])
    with pytest.raises(ConfigError, match="DeepEP's dispatcher"):
        resolve_config(ROOT / "examples" / "qwen3-30b-a3b" / "grpo.yaml", [f"+{moe}moe_enable_deepep=True"])
