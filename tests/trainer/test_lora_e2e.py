"""A LoRA run end to end on the session's engine and tiny model (tied Llama): merged weights are pushed and the sync
check holds at every step; the KL loss is taken against the base with the adapters off; the checkpoints hold the
adapters only and export a PEFT adapter; a run stopped by SIGTERM and resumed logs every step once, with the metrics
and the final adapters of the run trained straight through."""
import json

import pytest
import torch

from megatron_cpo.trainer.assemble import run_training
from tests.rollout.servers import assert_engine_in_sync
from tests.trainer.test_e2e import deterministic, read_metrics, send_sigterm_after_first_step

pytestmark = pytest.mark.usefixtures("restore_environment")

LORA = ("actor_rollout_ref.model.lora.rank=4", "actor_rollout_ref.model.lora.alpha=16",
        "actor_rollout_ref.model.lora.lora_A_init_method=kaiming", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.optim.lr=3e-2")


def test_a_lora_run_pushes_merged_weights_checkpoints_adapters_and_resumes_exactly(make_config, rollout_manager,
                                                                                  tmp_path):
    straight_dir, preempted_dir = tmp_path / "straight", tmp_path / "preempted"
    overrides = (*LORA, "trainer.total_training_steps=3", "trainer.val_before_train=false")
    run_training(make_config(*overrides, f"trainer.default_local_dir={straight_dir}"), rollout_manager)
    straight = read_metrics(straight_dir)
    assert sorted(straight) == [1, 2, 3]
    assert_engine_in_sync(straight, range(1, 4))
    assert straight[1]["actor/kl_loss"] == 0  # B = 0: the actor starts as its reference, the base
    # the adapted policy has left the base by far more than the sync check's 1e-4 (k3's mean ~ mean(dlogp^2) / 2):
    # an engine serving the base instead of the merged weights would have failed the check at steps 2 and 3
    assert straight[3]["actor/kl_loss"] > 1e-6 and straight[3]["kl"] > 0, straight[3]

    checkpoint = straight_dir / "checkpoints" / "step_000003"
    state = torch.load(checkpoint / "rank_00000.pt", weights_only=False)
    assert state["model"] and all(".lora_adapter.lora_" in name for name in state["model"])
    adapter = checkpoint / "huggingface"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16.0)
    assert (adapter / "adapter_model.safetensors").is_file() and not (adapter / "model.safetensors").exists()

    preempted = make_config(*overrides, f"trainer.default_local_dir={preempted_dir}", "trainer.resume=auto")
    watcher = send_sigterm_after_first_step(preempted_dir)
    run_training(preempted, rollout_manager)
    watcher.join(timeout=5)
    # SIGTERM arrives during step 2: the run finishes it, checkpoints and stops (3 only if step 2 beat the watcher)
    assert max(read_metrics(preempted_dir)) in (2, 3)
    run_training(preempted, rollout_manager)
    lines = [json.loads(line)["step"] for line in (preempted_dir / "metrics.jsonl").read_text().splitlines()]
    assert lines == [1, 2, 3]
    resumed = read_metrics(preempted_dir)
    for step in (1, 2, 3):
        expected, got = deterministic(straight[step]), deterministic(resumed[step])
        assert expected.keys() == got.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], abs=1e-6), (step, key)
    final = torch.load(preempted_dir / "checkpoints" / "step_000003" / "rank_00000.pt", weights_only=False)
    for name, tensor in state["model"].items():
        assert torch.allclose(final["model"][name], tensor, atol=1e-6), name
