"""Issue 39's repros as real runs (real Megatron, the session's vLLM engine, the real grading pool): a verl-style
custom reward function that returns NaN or infinity for some responses, under both `reward.non_finite` policies; a
checkpoint holding a NaN (as runs before the fix wrote them) on resume; a model whose own weights are not finite at
the first weight push. Nothing non-finite is trained, checkpointed or blamed on the engine."""
import json
import logging
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_cpo.trainer.assemble import run_training
from megatron_cpo.trainer.run.checkpoint_files import file_digest, write_manifest
from megatron_cpo.trainer.run.errors import RunAbortedError
from tests.trainer.test_e2e import read_metrics

pytestmark = pytest.mark.usefixtures("restore_environment")
FUNCTION = "tests.trainer.graders:non_finite_for_some"  # NaN or +inf for about two thirds of the responses


def poison_checkpoint(step_dir):
    """Put a NaN into the first weight of a checkpoint's rank file and re-sign its manifest, as a run before issue 39
    saved the weights it had trained into NaN."""
    rank_file = step_dir / "rank_00000.pt"
    state = torch.load(rank_file, weights_only=False)
    name, weight = next((name, value) for name, value in state["model"].items()
                        if isinstance(value, torch.Tensor) and value.is_floating_point())
    weight.view(-1)[0] = float("nan")
    torch.save(state, rank_file)
    manifest = json.loads((step_dir / "manifest.json").read_text())
    write_manifest(step_dir, manifest["step"], manifest["world_size"], {rank_file.name: file_digest(rank_file)})
    return name


def test_a_custom_reward_returning_nan_or_inf_stops_the_run_or_trains_as_zero_and_resume_skips_a_nan_checkpoint(
        make_config, rollout_manager, tmp_path, caplog):
    run = ("trainer.val_before_train=false", f"reward.custom_reward_function={FUNCTION}", "trainer.save_freq=1")

    refused_dir = tmp_path / "refused"
    with pytest.raises(RunAbortedError) as error:
        run_training(make_config(*run, "trainer.total_training_steps=2", f"trainer.default_local_dir={refused_dir}"),
                     rollout_manager)
    message = str(error.value)
    print(message)
    assert "\n" not in message
    assert message.startswith(f"step 1 stopped before its update: the custom reward function {FUNCTION} gave ")
    assert "for row " in message and "(data_source 'megatron_cpo/arith')" in message
    assert "set reward.non_finite=zero to train such scores as 0" in message and message.endswith("nothing was trained")
    assert not (refused_dir / "checkpoints").exists() or not any((refused_dir / "checkpoints").iterdir())
    assert 1 not in (read_metrics(refused_dir) if (refused_dir / "metrics.jsonl").is_file() else {})

    run_dir = tmp_path / "zero"
    zero = (*run, "reward.non_finite=zero", f"trainer.default_local_dir={run_dir}")
    run_training(make_config(*zero, "trainer.total_training_steps=2"), rollout_manager)
    metrics = read_metrics(run_dir)
    assert sorted(metrics) == [1, 2]
    assert sum(metrics[step]["reward/non_finite"] for step in (1, 2)) > 0
    for step in (1, 2):
        row = metrics[step]
        assert row["actor/update_skipped"] == 0 and math.isfinite(row["reward/mean"]), row
        assert math.isfinite(row["actor/pg_loss"]) and math.isfinite(row["actor/grad_norm"]), row

    poisoned = poison_checkpoint(run_dir / "checkpoints" / "step_000002")
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        run_training(make_config(*zero, "trainer.total_training_steps=3", "trainer.resume=auto"), rollout_manager)
    assert f"{run_dir / 'checkpoints' / 'step_000002' / 'rank_00000.pt'} holds a NaN or infinity in " \
           f"actor/model/{poisoned}" in caplog.text
    assert f"resuming from the intact checkpoint {run_dir / 'checkpoints' / 'step_000001'} (the newest with finite " \
           "values) instead" in caplog.text
    resumed = read_metrics(run_dir)  # steps 2 and 3 trained again from step 1's weights
    assert sorted(resumed) == [1, 2, 3] and all(math.isfinite(resumed[step]["actor/pg_loss"]) for step in (2, 3))
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000003"
    state = torch.load(run_dir / "checkpoints" / "step_000002" / "rank_00000.pt", weights_only=False)
    assert torch.isfinite(state["model"][poisoned]).all()  # written again, from finite weights


def test_a_model_whose_own_weights_are_not_finite_is_named_by_the_sync_check_not_the_engine(
        make_config, rollout_manager, tiny_model, tmp_path):
    model_dir = tmp_path / "nan-model"
    shutil.copytree(tiny_model, model_dir)
    weights = load_file(model_dir / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = make_config(f"actor_rollout_ref.model.path={model_dir}", "trainer.total_training_steps=1",
                         "trainer.val_before_train=false")
    with pytest.raises(RunAbortedError) as error:
        run_training(config, rollout_manager)
    message = str(error.value)
    print(message)
    assert "\n" not in message
    assert message.startswith("the trainer's own weights are not finite at the weight push before training (step 0): "
                              "the actor's log-prob of a sync-probe token is nan at engine 0, prompt 0, token 0; the "
                              "engines were sent these weights, so this is not an engine that serves other weights")
    assert message.endswith("no checkpoint was written before (check the model's weights in "
                            "actor_rollout_ref.model.path)")
    assert not (tmp_path / "run" / "checkpoints").exists()
