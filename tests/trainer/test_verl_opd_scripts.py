"""On-policy distillation's configuration: verl's OPD scripts (tests/fixtures/verl_overrides/opd_*.txt) load with
every value where verl puts it and pass `megatron-cpo train --dry-run` on local stand-in models; the teachers' table
loads from a file and from overrides; and each bad input is refused before anything starts, in one line naming the
key and the fix."""
import json
import shutil
from pathlib import Path

import pytest

from megatron_cpo.config import ConfigError, build_config, resolve_config
from tests.multiprocess import free_port
from tests.trainer.test_preflight import TINY_MODEL, _row, write_rows

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "verl_overrides"
SCRIPTS = {"opd_qwen3_8b_megatron.txt": {"actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.max_model_len",
                                         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "model_engine",
                                         "trainer.balance_batch", "ray_kwargs.ray_init.runtime_env.py_executable"},
           "opd_qwen3_0.6b_veomni.txt": {"actor_rollout_ref.rollout.name", "actor_rollout_ref.rollout.max_model_len",
                                         "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz", "model_engine",
                                         "actor_rollout_ref.actor.use_torch_compile",
                                         "actor_rollout_ref.actor.veomni.param_offload",
                                         "actor_rollout_ref.actor.veomni.optimizer_offload"}}


def overrides_of(name: str) -> list[str]:
    return [line for line in (FIXTURES / name).read_text().splitlines() if line and not line.startswith("#")]


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verls_opd_scripts_load_with_only_speed_settings_ignored(name):
    resolved = resolve_config(None, overrides_of(name))
    assert set(resolved.ignored) == SCRIPTS[name]
    config = resolved.config
    distillation, loss = config.distillation, config.distillation.distillation_loss
    assert distillation.enabled and config.actor_rollout_ref.rollout.n == 1
    assert (loss.use_task_rewards, loss.loss_max_clamp, loss.log_prob_min_clamp) == (False, 10.0, -10.0)
    if name == "opd_qwen3_8b_megatron.txt":
        teacher = distillation.teacher_models["teacher_model"]
        assert (loss.loss_mode, loss.use_policy_gradient, loss.teacher_topk) == ("forward_kl_topk", False, 64)
        assert (teacher.model_path, teacher.inference.tensor_model_parallel_size) == ("Qwen/Qwen3-32B", 2)
        assert distillation.replicas("teacher_model") == 2 and distillation.routing_key("teacher_model") == "default"
    else:
        teacher = distillation.teacher_models["gsm8k"]
        assert (loss.loss_mode, loss.use_policy_gradient, loss.teacher_topk) == ("k1", True, 0)
        assert (teacher.key, teacher.num_replicas, teacher.inference.max_model_len) == ("openai/gsm8k", 1, 1537)
        assert distillation.routing_key("gsm8k") == "openai/gsm8k"


def stand_in(folder: Path, **hf_settings) -> Path:
    """The tiny model's weights and tokenizer with the real model's settings the checks read."""
    shutil.copytree(TINY_MODEL, folder)
    hf = json.loads((folder / "config.json").read_text())
    hf.update(hf_settings)
    (folder / "config.json").write_text(json.dumps(hf))
    return folder


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_verls_opd_scripts_pass_the_dry_run(name, tmp_path, capsys, monkeypatch):
    """The scripts as they are but for the paths (the student's and the teacher's models: stand-ins with Qwen3's
    40960 positions; the data: rows of the script's data source) and the logger (wandb is not installed here)."""
    from megatron_cpo.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    student = stand_in(tmp_path / "student", max_position_embeddings=40960)
    teacher = stand_in(tmp_path / "teacher", max_position_embeddings=40960)
    data = write_rows(tmp_path / "train.parquet", [_row("openai/gsm8k", "#### 4"), _row("openai/gsm8k", "#### 5")])
    config = tmp_path / "empty.yaml"
    config.write_text("{}\n")
    entry = "teacher_model" if "megatron" in name else "gsm8k"
    main(["train", "--config", str(config), "--dry-run", *overrides_of(name), f"data.train_files={data}",
          f"data.val_files={data}", f"actor_rollout_ref.model.path={student}",
          f"distillation.teacher_models.{entry}.model_path={teacher}", f"trainer.default_local_dir={tmp_path / 'run'}",
          "trainer.logger=[console]"])
    out = capsys.readouterr().out
    assert "nothing was started" in out and str(teacher) in out
    if entry == "teacher_model":
        assert "# distillation: forward_kl_topk (top-64) as a loss, without the task loss" in out
        assert f"# teacher teacher_model: 2 engine(s) x TP 2 of {teacher}; scores every row" in out
    else:
        assert "# distillation: k1 as a reward (policy gradient), without the task loss" in out
        assert f"# teacher gsm8k: 1 engine(s) x TP 1 of {teacher}; scores rows with data_source=openai/gsm8k" in out


def test_teacher_engines_launch_at_the_scripts_size_and_return_the_top_k(tmp_path):
    """The 8B script's teacher: 2 engines (its pool of 4 devices at TP 2), the sequences of the run plus the one
    generated token, the actor's dtype, vLLM's log-prob cap raised to the loss's top-64."""
    from megatron_cpo.rollout.engine_teacher import teacher_launch_config

    teacher = stand_in(tmp_path / "teacher")
    config = resolve_config(None, [*overrides_of("opd_qwen3_8b_megatron.txt"),
                                   f"distillation.teacher_models.teacher_model.model_path={teacher}"]).config
    launch = teacher_launch_config("teacher_model", config.distillation, "bfloat16", 3073, 7, "local")
    assert (launch.engines.num_engines, launch.engines.tensor_model_parallel_size) == (2, 2)
    assert (launch.model_path, launch.max_model_len, launch.dtype, launch.seed) == (str(teacher), 3073, "bfloat16", 7)
    assert (launch.max_logprobs, launch.engines.gpu_memory_utilization, launch.engines.ray_address) == (64, 0.4,
                                                                                                        "local")


def test_the_teachers_table_loads_from_a_file_and_overrides():
    tree = {"distillation": {"enabled": True, "teacher_models": {
        "gsm8k": {"key": "openai/gsm8k", "model_path": "/m/a", "inference": {"max_model_len": 100}},
        "math": {"key": "math", "kind": "server", "server_urls": ["http://teacher:8000"], "server_token_file": "/t"}}}}
    config = build_config(tree, ["distillation.teacher_models.gsm8k.inference.tensor_model_parallel_size=2",
                                 "+distillation.teacher_models.code.key=code",
                                 "distillation.teacher_models.code.model_path=/m/c"])
    teachers = config.distillation.teacher_models
    assert list(teachers) == ["gsm8k", "math", "code"]
    assert (teachers["gsm8k"].inference.max_model_len, teachers["gsm8k"].inference.tensor_model_parallel_size) == (
        100, 2)
    assert (teachers["math"].kind, teachers["code"].kind) == ("server", "engines")
    assert teachers["math"].server_urls == ["http://teacher:8000"] and teachers["code"].model_path == "/m/c"
    with pytest.raises(ConfigError, match="unknown config key 'distillation.teacher_models.gsm8k.model_pth'; did you "
                                          "mean 'distillation.teacher_models.gsm8k.model_path'"):
        build_config(tree, ["distillation.teacher_models.gsm8k.model_pth=/x"])


@pytest.mark.parametrize("overrides, message", [
    (["distillation.enabled=true"], "distillation.enabled=true needs a teacher; set "
                                    "distillation.teacher_models.teacher_model.model_path=<HF dir>"),
    (["distillation.teacher_models.teacher_model.model_path=/m", "distillation.teacher_models.b.model_path=/m",
      "distillation.teacher_models.b.key=b"], "verl drops teacher_model silently then; give it another name"),
    (["distillation.teacher_models.a.model_path=/m"], "distillation.teacher_models.a.key is not set"),
    (["distillation.teacher_models.teacher_model.kind=self", "distillation.teacher_models.teacher_model.model_path=/m"],
     "kind=self is the policy itself given the gold solution; remove"),
    (["distillation.teacher_models.teacher_model.kind=server"], "kind=server needs "
                                                                "distillation.teacher_models.teacher_model.server_urls"),
    (["distillation.teacher_models.teacher_model.model_path=/m", "distillation.opd_kl_coef=1.0"],
     "opd_kl_coef=1.0 (slime's additive form) subtracts coef x (student - teacher) log-probs, the k1 estimator; set "
     "distillation.distillation_loss.loss_mode=k1"),
    (["distillation.teacher_models.teacher_model.model_path=/m", "distillation.nnodes=1",
      "distillation.n_gpus_per_node=3",
      "distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=2"],
     "one replica takes 2 devices, which does not divide the teacher pool"),
    (["distillation.teacher_models.teacher_model.model_path=/m", "distillation.distillation_loss.loss_mode=k1"],
     "loss_mode=k1 as a loss (use_policy_gradient=false) has a gradient that does not depend on the teacher"),
    (["distillation.teacher_models.a.kind=megatron", "distillation.teacher_models.a.model_path=/m",
      "distillation.teacher_models.a.key=a", "distillation.teacher_models.b.model_path=/m",
      "distillation.teacher_models.b.key=b"], "a (kind megatron) beside other teachers is not available yet"),
    (["distillation.teacher_models.teacher_model.kind=self", "algorithm.adv_estimator=cpo"],
     "kind=self teacher and algorithm.adv_estimator=cpo is not available yet"),
    (["distillation.teacher_models.teacher_model.kind=megatron", "distillation.teacher_models.teacher_model.model_path"
      "=/m", "actor_rollout_ref.rollout.mode=colocate"], "kind=megatron with actor_rollout_ref.rollout.mode=colocate "
                                                         "is not available yet"),
])
def test_a_bad_teacher_config_is_refused_at_load(overrides, message):
    enabled = [] if overrides == ["distillation.enabled=true"] else ["distillation.enabled=true"]
    with pytest.raises(ConfigError) as err:
        build_config({}, enabled + overrides)
    assert message in str(err.value)


@pytest.fixture
def student(tmp_path):
    return stand_in(tmp_path / "student")


def preflight_problem(tmp_path, student, *overrides):
    from megatron_cpo.trainer.run.preflight import preflight

    data = write_rows(tmp_path / "train.parquet", [_row(), _row("openai/gsm8k", "#### 4")])
    config = build_config({}, [f"actor_rollout_ref.model.path={student}", f"data.train_files={data}",
                               f"data.val_files={data}", "data.max_prompt_length=256",
                               "data.max_response_length=256", f"trainer.default_local_dir={tmp_path / 'run'}",
                               "distillation.enabled=true", "distillation.distillation_loss.loss_mode=k3",
                               *overrides])
    with pytest.raises(ConfigError) as err:
        preflight(config, planning=True)
    return str(err.value)


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, student):
    teacher = stand_in(tmp_path / "teacher")
    tokenizer = json.loads((teacher / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["0"], vocab["1"] = vocab["1"], vocab["0"]  # two tokens trade ids: same sizes, other ids
    (teacher / "tokenizer.json").write_text(json.dumps(tokenizer))
    padded = stand_in(tmp_path / "padded", vocab_size=160)  # another padded size of the same tokenizer is fine
    message = preflight_problem(tmp_path, student, f"distillation.teacher_models.teacher_model.model_path={teacher}")
    assert message.startswith(f"distillation.teacher_models.teacher_model.model_path={str(teacher)!r} does not share "
                              "the student's tokenizer")
    assert "2 of the student's 100 tokens are missing or have another id" in message
    assert "cross-tokenizer distillation is not supported" in message
    assert "padded" not in preflight_problem(tmp_path, student, "distillation.teacher_models.teacher_model.model_path="
                                             f"{padded}", "distillation.teacher_models.teacher_model.inference."
                                             "max_model_len=10")


@pytest.mark.parametrize("overrides, message", [
    (["distillation.teacher_models.teacher_model.inference.max_model_len=300"],
     "distillation.teacher_models.teacher_model.inference.max_model_len=300 is shorter than data.max_prompt_length + "
     "data.max_response_length + 1 = 513 (a sampled sequence and the token vLLM generates); set it to 513 or null"),
    (["distillation.teacher_models.teacher_model.model_path=Qwen/Qwen3-32B"],
     "distillation.teacher_models.teacher_model.model_path='Qwen/Qwen3-32B' is not a model directory (no "
     "config.json); download it first (huggingface-cli download Qwen/Qwen3-32B --local-dir <dir>)"),
    (["distillation.teacher_models.gsm8k.key=openai/gsm8k"],
     "has rows whose distillation.teacher_key=data_source is 'megatron_cpo/arith', which no teacher scores"),
    (["distillation.teacher_models.teacher_model.kind=megatron", "distillation.teacher_models.teacher_model.load=/no"],
     "distillation.teacher_models.teacher_model.load='/no' does not exist"),
    (["distillation.teacher_models.teacher_model.inference.tensor_model_parallel_size=3"],
     "inference.tensor_model_parallel_size=3 does not divide the teacher's num_attention_heads=4"),
])
def test_bad_teachers_are_refused_before_anything_starts(tmp_path, student, overrides, message):
    entry = "gsm8k" if "gsm8k" in overrides[0] else "teacher_model"
    teacher = [] if "model_path" in overrides[0] else [f"distillation.teacher_models.{entry}.model_path={student}"]
    assert message in preflight_problem(tmp_path, student, *teacher, *overrides)


def test_an_unreachable_teacher_server_is_named_at_start(tmp_path, student):
    url = f"http://127.0.0.1:{free_port()}"
    token = tmp_path / "token"
    token.write_text("secret\n")
    message = preflight_problem(tmp_path, student, "distillation.teacher_models.teacher_model.kind=server",
                                f"distillation.teacher_models.teacher_model.server_urls=[{url}]",
                                f"distillation.teacher_models.teacher_model.server_token_file={token}")
    assert message.startswith(f"distillation.teacher_models.teacher_model.server_urls holds {url}, which does not "
                              "answer")
    assert "start it (megatron-cpo rollout --model <teacher>) or fix the URL" in message
