"""Pre-start checks on real files: each bad model, data, layout or output setting is named before anything starts,
all at once; `train --dry-run` prints the config and the layout; TP=3 fails in a real `megatron-cpo train` before Ray.
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from megatron_cpo.compute_dtype import resolve_dtype
from megatron_cpo.config import ConfigError, build_config
from megatron_cpo.trainer.run.preflight import preflight

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "tiny" / "model"  # num_attention_heads 4, num_key_value_heads 2, 2 layers


def _row(source="megatron_cpo/arith", truth="4"):
    return {"prompt": [{"role": "user", "content": "2+2?"}], "data_source": source,
            "reward_model": {"style": "rule", "ground_truth": truth}, "extra_info": {"index": 0}}


def write_rows(path: Path, rows: list[dict]) -> str:
    schema = pa.table({k: [v] for k, v in _row().items()}).schema
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return str(path)


@pytest.fixture
def files(tmp_path):
    return {"train": write_rows(tmp_path / "train.parquet", [_row(), _row(truth="5")]),
            "val": write_rows(tmp_path / "val.parquet", [_row()])}


@pytest.fixture
def make(files, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)

    def make(*overrides):
        return build_config({}, [f"actor_rollout_ref.model.path={TINY_MODEL}", f"data.train_files={files['train']}",
                                 f"data.val_files={files['val']}", "data.train_batch_size=2",
                                 "actor_rollout_ref.actor.ppo_mini_batch_size=1",
                                 f"trainer.default_local_dir={tmp_path / 'run'}", *overrides])
    return make


def problems_of(config, planning=False) -> str:
    with pytest.raises(ConfigError) as err:
        preflight(config, planning)
    return str(err.value)


def test_a_valid_config_gives_its_layout(make):
    plan = preflight(make("actor_rollout_ref.rollout.n=4", "trainer.total_epochs=3"))
    # 2 prompts x n=4 responses; train_batch_size 2 / mini 1 = 2 optimizer steps of 4 responses, micro 8 -> 1 each
    assert (plan.layout.world_size, plan.layout.dp, plan.responses_per_step) == (1, 1, 8)
    assert (plan.mini_batches_per_step, plan.micro_batches_per_rank) == (2, 1)
    assert (plan.train_prompts, plan.steps, plan.generation_batch) == (2, 3, 2)  # 3 epochs of 1 step
    # one rule for "needs a reference model", the one the trainer builds by (verl's reference sync needs one too)
    assert not plan.layout.reference_model
    assert preflight(make("actor_rollout_ref.ref.sync_ref_model=true")).layout.reference_model


def test_model_path_missing_or_not_a_model(make, tmp_path):
    assert ("actor_rollout_ref.model.path='Qwen/Qwen2-7B-Instruct' does not exist; download it first "
            "(huggingface-cli download Qwen/Qwen2-7B-Instruct") in problems_of(make(
                "actor_rollout_ref.model.path=Qwen/Qwen2-7B-Instruct"))
    (tmp_path / "empty_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    for path in (tmp_path / "empty_dir", tmp_path / "a_file"):
        assert f"actor_rollout_ref.model.path='{path}' is not a model directory (no config.json)" in problems_of(
            make(f"actor_rollout_ref.model.path={path}"))
    weightless = tmp_path / "weightless"
    weightless.mkdir()
    shutil.copy(TINY_MODEL / "config.json", weightless / "config.json")
    message = problems_of(make(f"actor_rollout_ref.model.path={weightless}"))
    assert "holds no weights" in message and "holds no tokenizer" in message


@pytest.mark.parametrize("override, expected", [
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
     "tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4"),
    ("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4",
     "tensor_model_parallel_size=4 does not divide the model's num_key_value_heads=2"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=3",
     "pipeline_model_parallel_size=3 does not divide the model's num_hidden_layers=2"),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=3",
     "rollout.tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4"),
    ("actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
     "= 2 does not divide the trainer's 1 process(es) (a single process)"),
])
def test_layout_is_checked_against_the_model_and_the_world(make, override, expected):
    assert expected in problems_of(make(override))


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    """A stand-in Qwen3-MoE folder (4 heads / 2 KV heads, 2 layers, 4 experts of width 64): the tiny model's files with
    a Qwen3-MoE config.json, all that preflight reads."""
    model = tmp_path_factory.mktemp("moe") / "model"
    shutil.copytree(TINY_MODEL, model)
    hf = json.loads((model / "config.json").read_text())
    hf.pop("layer_types", None)
    hf.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], head_dim=32, num_experts=4,
              num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True, decoder_sparse_step=1,
              mlp_only_layers=[], attention_bias=False)
    (model / "config.json").write_text(json.dumps(hf))
    return model


MEGATRON = "actor_rollout_ref.actor.megatron."


@pytest.mark.parametrize("overrides, expected", [
    ((f"{MEGATRON}expert_model_parallel_size=2",),
     "pipeline_model_parallel_size=1 x expert_model_parallel_size=2 x expert_tensor_parallel_size=1 = 2 does not "
     "divide the trainer's 1 process(es)"),
    (("trainer.nnodes=1", "trainer.n_gpus_per_node=3", f"{MEGATRON}expert_model_parallel_size=3"),
     "EP=3 does not divide the 4 experts; choose an expert-parallel size (expert_model_parallel_size, --ep)"),
    (("trainer.nnodes=1", "trainer.n_gpus_per_node=2", f"{MEGATRON}tensor_model_parallel_size=2"),
     "tensor_model_parallel_size=2 with a mixture of experts needs actor_rollout_ref.actor.megatron."
     "sequence_parallel=true"),
    (("trainer.nnodes=1", "trainer.n_gpus_per_node=2", f"{MEGATRON}expert_tensor_parallel_size=2",
      f"{MEGATRON}expert_model_parallel_size=1"), None),  # ETP=2 over the two ranks: a valid layout
    (("actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
      "trainer.nnodes=1", "trainer.n_gpus_per_node=2", f"{MEGATRON}pipeline_model_parallel_size=2"),
     "router_replay.mode=R2 with full recompute under pipeline_model_parallel_size=2 would replay another "
     "micro-batch's routing"),
])
def test_expert_layouts_are_checked_against_the_model_and_the_world(make, moe_model, overrides, expected):
    config = make(f"actor_rollout_ref.model.path={moe_model}", *overrides)
    if expected is None:
        layout = preflight(config, planning=True).layout
        assert (layout.world_size, layout.ep, layout.etp, layout.expert_dp) == (2, 1, 2, 1)
    else:
        assert expected in problems_of(config, planning=True)


@pytest.mark.parametrize("override, expected", [
    (f"{MEGATRON}expert_model_parallel_size=2", "split experts, but model_type='qwen2' is dense"),
    ("actor_rollout_ref.actor.router_replay.mode=R2", "router_replay.mode=R2 replays a mixture of experts' routing, "
     "but model_type='qwen2' is dense; set it to disabled"),
    (f"{MEGATRON}freeze_moe_router=true", "freeze_moe_router=true, but model_type='qwen2' has no router"),
])
def test_moe_settings_on_a_dense_model_are_refused(make, override, expected):
    config = make(override, "trainer.nnodes=1", "trainer.n_gpus_per_node=2")
    assert expected in problems_of(config, planning=True)


@pytest.mark.parametrize("overrides, expected", [
    (("algorithm.adv_estimator=gae", "critic.enable=false"),
     "algorithm.adv_estimator=gae needs a critic's values, and critic.enable=false turns the critic off; set "
     "critic.enable=true (or leave it null), or choose a critic-free estimator"),
    (("critic.enable=true",), "critic.enable=true sets up a critic, but algorithm.adv_estimator=grpo does not read "
                              "its values (only gae does); set algorithm.adv_estimator=gae, or remove the critic's "
                              "settings (critic.enable=null)"),
    (("algorithm.adv_estimator=rloo", f"critic.model.path={TINY_MODEL}"),
     f"critic.model.path='{TINY_MODEL}' sets up a critic, but algorithm.adv_estimator=rloo does not read its values"),
    (("trainer.critic_warmup=2",), "trainer.critic_warmup=2 trains only a critic in the first steps, and "
                                   "algorithm.adv_estimator=grpo has none; set it to 0 (or use gae)"),
])
def test_a_critic_exactly_when_the_estimator_reads_values(make, overrides, expected):
    """gae without a critic, a critic (or its warm-up) with another estimator: one line naming the key and the fix,
    when the config loads (before preflight, Ray or any engine)."""
    with pytest.raises(ConfigError) as err:
        make(*overrides)
    assert expected in str(err.value) and "\n" not in str(err.value)


def test_a_critic_checkpoint_of_another_architecture_is_refused_before_starting(make, tmp_path):
    assert preflight(make("algorithm.adv_estimator=gae")).layout.critic  # the layout counts a critic
    same = tmp_path / "same_architecture"
    shutil.copytree(TINY_MODEL, same)
    preflight(make("algorithm.adv_estimator=gae", f"critic.model.path={same}"))
    other = tmp_path / "other_architecture"
    shutil.copytree(TINY_MODEL, other)
    hf_config = json.loads((other / "config.json").read_text())
    hf_config.update(hidden_size=2 * hf_config["hidden_size"], num_hidden_layers=hf_config["num_hidden_layers"] + 1)
    (other / "config.json").write_text(json.dumps(hf_config))
    message = problems_of(make("algorithm.adv_estimator=gae", f"critic.model.path={other}"))
    assert message.startswith(f"critic.model.path='{other}' is another architecture than the actor's "
                              f"actor_rollout_ref.model.path='{TINY_MODEL}': hidden_size {hf_config['hidden_size']} "
                              f"(the actor's: {hf_config['hidden_size'] // 2}); num_hidden_layers")
    assert "point critic.model.path at a checkpoint of the actor's architecture" in message and "\n" not in message
    assert "is not a model directory (no config.json)" in problems_of(
        make("algorithm.adv_estimator=gae", f"critic.model.path={tmp_path}"))


def test_nnodes_times_gpus_must_be_the_world_but_plans_a_dry_run(make, monkeypatch):
    config = make("trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor_rollout_ref.actor.megatron."
                  "tensor_model_parallel_size=2")
    assert ("trainer.nnodes=2 x trainer.n_gpus_per_node=8 = 16 but the trainer runs on 1 process(es)"
            in problems_of(config))
    layout = preflight(config, planning=True).layout
    assert (layout.world_size, layout.tp, layout.dp) == (16, 2, 8)
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert preflight(config).layout.world_size == 16


def test_data_problems_are_named(make, tmp_path):
    empty = write_rows(tmp_path / "empty.parquet", [])
    assert f"data.train_files: {empty}: has no rows" in problems_of(make(f"data.train_files={empty}"))
    blank = write_rows(tmp_path / "blank.parquet", [_row(truth=""), _row(truth=" "), _row()])
    message = problems_of(make(f"data.train_files={blank}"))  # the dataset's own row check (data/dataset.py)
    assert f"data.train_files: 2 bad row(s) in {blank}" in message
    assert "row 1: reward_model.ground_truth is empty: no response can be graded right against it" in message
    unknown = write_rows(tmp_path / "unknown.parquet", [_row(source="my_task")])
    assert "no grader for data_source 'my_task'" in problems_of(make(f"data.val_files={unknown}"))
    assert "data.prompt_key='question' is not a column" in problems_of(make("data.prompt_key=question"))
    assert f"'{tmp_path}' is a directory" in problems_of(make(f"data.train_files={tmp_path}"))
    (tmp_path / "text.parquet").write_text("not parquet")
    assert "is not a readable parquet file" in problems_of(make(f"data.train_files={tmp_path / 'text.parquet'}"))


def test_a_custom_reward_function_grades_any_source_without_ground_truths(make, tmp_path):
    unknown = write_rows(tmp_path / "unknown.parquet", [_row(source="my_task", truth="")])
    preflight(make(f"data.train_files={unknown}", "reward.custom_reward_function=tests.trainer.graders:never_correct"))


def test_output_folder_that_is_a_file(make, tmp_path):
    (tmp_path / "out_file").write_text("x")
    assert "'{}' is a file, not a folder".format(tmp_path / "out_file") in problems_of(
        make(f"trainer.default_local_dir={tmp_path / 'out_file'}"))
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "checkpoints").write_text("x")
    assert "'{}' is a file, not a folder".format(tmp_path / "run2" / "checkpoints") in problems_of(
        make(f"trainer.default_local_dir={tmp_path / 'run2'}"))


def test_every_problem_is_reported_at_once(make, tmp_path):
    empty = write_rows(tmp_path / "empty.parquet", [])
    (tmp_path / "out_file").write_text("x")
    message = problems_of(make("actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3",
                               f"data.train_files={empty}", f"trainer.default_local_dir={tmp_path / 'out_file'}"))
    assert message.startswith("5 problems found before starting:")  # heads, KV heads, world, empty file, output


def test_dry_run_prints_config_ignored_keys_and_layout(files, tmp_path, capsys, monkeypatch):
    from megatron_cpo.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    main(["train", "--config", str(ROOT / "examples/tiny/grpo_arith.yaml"), "--dry-run",
          f"data.train_files={files['train']}", f"data.val_files={files['val']}",
          f"trainer.default_local_dir={tmp_path / 'run'}", "actor_rollout_ref.rollout.name=vllm",
          "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
          "actor_rollout_ref.actor.megatron.params_dtype=auto"])
    out = capsys.readouterr().out
    assert "# resolved config" in out and "  train_batch_size: 2" in out
    assert "# 1 verl setting(s) accepted but not used here: actor_rollout_ref.rollout.name='vllm'" in out
    assert "# trainer: 1 process(es) (a single process) = TP 1 x PP 1 x DP 1" in out
    assert "# per step: 16 responses in 1 optimizer step(s)" in out  # 2 prompts x n=8
    chosen = resolve_dtype("auto")  # tests/foundation/test_compute_dtype.py checks the rule
    assert (f"# dtype of the actor and the engines: {chosen.name} (actor_rollout_ref.actor.megatron.params_dtype=auto: "
            f"{chosen.reason})") in out
    assert not (tmp_path / "run").exists(), "a dry run writes nothing"


# The real models' config.json values that the layout checks read (heads, layers, experts), on the Hub.
STAND_IN_DIMENSIONS = {
    "qwen2.5-math-1.5b": dict(num_attention_heads=12, num_key_value_heads=2, num_hidden_layers=28),
    "qwen2.5-math-7b": dict(num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28),
    "qwen3-8b": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, num_hidden_layers=36),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, num_hidden_layers=48, num_experts=128,
                          num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
                          decoder_sparse_step=1, mlp_only_layers=[], attention_bias=False),
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, hidden_size=576, num_hidden_layers=30,
                         tie_word_embeddings=True),
}


@pytest.mark.parametrize("recipe", sorted(str(p.relative_to(ROOT)) for p in ROOT.glob("examples/*/*.yaml")))
def test_dry_run_on_every_shipped_recipe(recipe, files, tmp_path, capsys, monkeypatch):
    """Tiny recipes run as shipped (on this test's data); the real models' recipes (Qwen, SmolLM2: its model is
    fetched once by tools/fetch_smollm2.py, not in CI) on a stand-in model folder that holds the real model's
    config.json dimensions (heads, layers) but tiny weights, at the layout their header documents."""
    from megatron_cpo.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    overrides = [f"data.train_files={files['train']}", f"data.val_files={files['val']}",
                 f"trainer.default_local_dir={tmp_path / 'run'}"]
    if recipe.split("/")[1] in STAND_IN_DIMENSIONS:
        model = tmp_path / "model"
        shutil.copytree(TINY_MODEL, model)
        hf = json.loads((model / "config.json").read_text())
        hf.pop("layer_types", None)  # transformers derives it from num_hidden_layers
        hf.update(STAND_IN_DIMENSIONS[recipe.split("/")[1]])
        (model / "config.json").write_text(json.dumps(hf))
        nodes = 1 if recipe.split("/")[1] in ("qwen2.5-math-1.5b", "qwen3-8b") else 2  # as their headers say
        overrides.append(f"actor_rollout_ref.model.path={model}")
        if "qwen" in recipe:
            overrides += [f"trainer.nnodes={nodes}", "trainer.n_gpus_per_node=8"]
    main(["train", "--config", str(ROOT / recipe), "--dry-run", *overrides])
    out = capsys.readouterr().out
    assert "nothing was started" in out
    if "qwen3-30b-a3b" in recipe:
        assert "TP 4 x PP 1 x DP 4; experts: EP 8 x ETP 1 x expert-DP 2 per pipeline stage" in out


@pytest.mark.slow  # a fresh interpreter importing the trainer
def test_tp3_fails_in_a_real_train_command_before_ray_starts(files, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "megatron_cpo.cli", "train", "--config", str(ROOT / "examples/tiny/grpo_arith.yaml"),
         f"data.train_files={files['train']}", f"data.val_files={files['val']}",
         f"trainer.default_local_dir={tmp_path / 'run'}", "actor_rollout_ref.rollout.ray_address=local",
         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=3"],
        capture_output=True, text=True, env=env, timeout=300)
    seconds = time.perf_counter() - start
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("error: 2 problems found before starting:") or "does not divide" in result.stderr
    assert "tensor_model_parallel_size=3 does not divide the model's num_attention_heads=4" in result.stderr
    assert "Traceback" not in result.stderr
    assert "ray" not in (result.stdout + result.stderr).lower(), "Ray must not have started"
    assert not (tmp_path / "run").exists()
    assert seconds < 60, f"took {seconds:.1f}s"  # measured about 10 s on a loaded 2-core machine


def test_a_run_that_cannot_form_its_first_batch_is_an_error(make_config, rollout_manager):
    """Every group filtered (a grader that marks everything wrong, as empty ground truths would) used to end the
    run after zero steps with exit status 0."""
    from megatron_cpo.trainer.assemble import run_training

    config = make_config("algorithm.filter_groups.enable=true", "trainer.total_training_steps=2",
                         "reward.custom_reward_function=tests.trainer.graders:never_correct",
                         "trainer.val_before_train=false")
    with pytest.raises(ValueError, match="no training batch could be formed at step 1: the filters dropped every "
                                         "group before data.train_batch_size=4 were kept"):
        run_training(config, rollout_manager)


def test_context_parallelism_names_what_it_needs(make):
    from megatron_cpo.models.builder import uses_transformer_engine

    message = problems_of(make("actor_rollout_ref.actor.megatron.context_parallel_size=2"))
    if uses_transformer_engine():  # GPU build: only the layout (1 process, CP=2) is wrong
        assert "x context_parallel_size=2 = 2 does not divide the trainer's 1 process(es)" in message
    else:
        assert ("actor_rollout_ref.actor.megatron.context_parallel_size=2 needs Transformer Engine (its ring "
                "attention; GPU only), which is not importable here; set context_parallel_size=1 or install "
                "transformer_engine") in message
