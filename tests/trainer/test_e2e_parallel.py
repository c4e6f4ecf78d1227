"""Whole training runs with two trainer processes under one rank-0 controller, all in the same two processes and on
one engine (rank 0 starts it once; a run always pushes its weights before its first rollout): PP=2, then DP=2; then
the same two layouts with a NaN in one rank's log-probs.

Clean runs. Rank 0 drives the engine and broadcasts the batch; with PP=2 both pipeline stages export their layers
straight into the engine; with DP=2 only the first replica exports (a second copy of the weights would be loaded
twice). The run must log the same first-step rollout metrics as the layout-independent controller would and finish
with held-out accuracy, i.e. the collective protocol (batch broadcast, log-prob broadcast, weight push from two
senders, checkpoint barrier) completes. The model has tied embeddings (with PP=2 the last stage keeps its own copy of
the embedding as the output layer, which is never sent) and trains at learning rate 3e-2: after every push the
engine's log-probs, of its samples and of the sync probe, equal the trainer's.

Non-finite runs. A NaN in the log-probs of one micro-batch on one rank: the update of that step is skipped on both
ranks and the weights stay those of the last applied update, bit for bit on every rank; two skipped steps in a row
end the run (`actor_rollout_ref.actor.max_consecutive_skipped_updates=2`) with one line naming the log-probs as where
the first non-finite value appeared, checkpointed; resuming trains on. (A single skip followed by an applied update:
tests/trainer/test_non_finite.py.) The NaN is put there by a hook that exists only in this test: it wraps
`MegatronPolicy._log_probs_entropy` so that, on global rank 1 (a DP replica that is not rank 0; with PP=2 the last
stage, where the log-probs are), the first micro-batch of the chosen updates' forward comes out NaN. It is installed
after the clean runs.

Each run's process group meets on its own port, so that a rank done with one run cannot join the previous run's store.
"""
import json
import os

import pytest
import torch

from tests.multiprocess import free_port, run_processes
from tests.rollout.servers import assert_engine_in_sync

LAYOUTS = {"pp2": 2, "dp2": 1}  # layout: pipeline_model_parallel_size (the other factor of the 2 ranks is DP)
POISONED_UPDATES = {2, 3}  # one optimizer step per training step here


def inject_nan_log_probs(updates: set[int]) -> dict:
    """The test's hook: NaN log-probs in the first micro-batch of each listed update (1-based, counted from the last
    time the returned state's "update" was set to 0) on global rank 1."""
    import torch.distributed as dist

    from megatron_cpo.trainer.workers.actor import MegatronPolicy

    real_update, real_log_probs = MegatronPolicy._train_step, MegatronPolicy._log_probs_entropy
    state = {"update": 0, "poisoned": True}

    def counting_update(self, *args, **kwargs):
        state["update"], state["poisoned"] = state["update"] + 1, False
        return real_update(self, *args, **kwargs)

    def poisoned_log_probs(self, output, seqs, temperature):
        log_probs, entropy = real_log_probs(self, output, seqs, temperature)
        if torch.is_grad_enabled() and dist.get_rank() == 1 and not state["poisoned"] and state["update"] in updates:
            state["poisoned"] = True
            log_probs = log_probs + float("nan")
        return log_probs, entropy

    MegatronPolicy._train_step, MegatronPolicy._log_probs_entropy = counting_update, poisoned_log_probs
    return state


def run_overrides(model_dir, data, run_dir, layout, pipeline_size) -> list[str]:
    """What every run of this module shares: the session's tiny model and data, 2 prompts x 2 samples."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}", "data.train_batch_size=2",
            "data.max_prompt_length=384", "data.max_response_length=8", "actor_rollout_ref.rollout.n=2",
            "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pipeline_size}",
            "actor_rollout_ref.rollout.ray_address=local", "reward.num_workers=1",
            "reward.custom_reward_function=tests.trainer.graders:even_first_character",
            f"trainer.default_local_dir={run_dir}/{layout}", "trainer.logger=[jsonl]"]


def train_every_layout(rank, world_size, model_dir, data, run_dir, ports):
    """The clean PP=2 and DP=2 runs (2 steps each), then per layout a 3-step run with NaN log-probs at steps 2 and 3
    (it stops after step 3) and the same run resumed to step 4 without them; one engine for all six runs."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.config import build_config
    from megatron_cpo.rollout.modes import build_rollout_manager
    from megatron_cpo.trainer.assemble import run_training
    from megatron_cpo.trainer.components import engine_launch_config
    from megatron_cpo.trainer.run.errors import RunAbortedError

    def clean(layout, pipeline_size):
        return build_config({}, [*run_overrides(model_dir, data, f"{run_dir}/clean", layout, pipeline_size),
                                 f"data.val_files={data['test']}",
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
                                 "actor_rollout_ref.actor.optim.lr=3e-2", "trainer.total_training_steps=2",
                                 "trainer.save_freq=2"])

    def non_finite(layout, pipeline_size, steps):
        return build_config({}, [*run_overrides(model_dir, data, f"{run_dir}/non_finite", layout, pipeline_size),
                                 "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",
                                 "actor_rollout_ref.actor.optim.lr=1e-2",
                                 "actor_rollout_ref.actor.max_consecutive_skipped_updates=2",
                                 "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
                                 f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                                 "trainer.val_before_train=false"])

    first = clean("pp2", LAYOUTS["pp2"])
    manager = build_rollout_manager(first.actor_rollout_ref.rollout, engine_launch_config(first)) if rank == 0 else None
    results, port = {"clean": {}, "non_finite": {}}, iter(ports)
    try:
        for index, (layout, pipeline_size) in enumerate(LAYOUTS.items()):
            if index:
                os.environ["MASTER_PORT"] = str(next(port))
            results["clean"][layout] = run_training(clean(layout, pipeline_size), manager)
        counter = inject_nan_log_probs(POISONED_UPDATES)
        for layout, pipeline_size in LAYOUTS.items():
            os.environ["MASTER_PORT"] = str(next(port))
            counter["update"] = 0
            try:
                run_training(non_finite(layout, pipeline_size, 3), manager)
                results["non_finite"][layout] = "no error"
            except RunAbortedError as err:
                results["non_finite"][layout] = str(err)
            os.environ["MASTER_PORT"] = str(next(port))
            run_training(non_finite(layout, pipeline_size, 4), manager)  # resumed from step 3; no update to poison
    finally:
        if manager is not None:
            manager.shutdown()
    return results


@pytest.fixture(scope="module")
def two_rank_runs(tiny_model, arith_data, tmp_path_factory):
    """Every run of this module, in one spawn of two ranks: (results by rank, the runs' directory)."""
    run_dir = tmp_path_factory.mktemp("two_rank_runs")
    results = run_processes(train_every_layout, 2, tiny_model, arith_data, str(run_dir),
                            [free_port() for _ in range(5)], timeout=1500)
    return results, run_dir


# generous: the runs' one engine took ~10 min to start at load average 13-58 (shared 2 cores); the first test pays it
@pytest.mark.timeout(1800)
def test_two_rank_training_runs(two_rank_runs, tiny_model):
    """PP=2 and DP=2, one run each."""
    results, run_dir = two_rank_runs
    for layout in LAYOUTS:
        layout_dir = run_dir / "clean" / layout
        assert "val/acc" in results[0]["clean"][layout] and results[1]["clean"][layout] == {}, layout
        rows = [json.loads(line) for line in (layout_dir / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1, 2], layout  # the last step's row carries the final validation
        assert_engine_in_sync({row["step"]: row for row in rows}, (1, 2))
        step_dir = layout_dir / "checkpoints" / "step_000002"
        assert sorted(p.name for p in step_dir.iterdir()) == ["huggingface", "manifest.json", "rank_00000.pt",
                                                              "rank_00001.pt"]
        manifest = json.loads((step_dir / "manifest.json").read_text())
        assert manifest["world_size"] == 2 and sorted(manifest["files"]) == ["rank_00000.pt", "rank_00001.pt"]
        assert_loads_as_the_tiny_model(step_dir / "huggingface", tiny_model)


@pytest.mark.timeout(1800)
def test_nan_log_probs_on_one_rank_skip_the_update_everywhere_then_stop_the_run_and_resume_trains_on(
        two_rank_runs):
    results, runs = two_rank_runs
    for layout in LAYOUTS:
        run_dir = runs / "non_finite" / layout
        messages = {results[rank]["non_finite"][layout] for rank in (0, 1)}
        assert len(messages) == 1, messages  # every rank stopped with the same line
        [message] = messages
        # the loss is NaN; its gradient need not be (the clipped ratio's gradient at NaN is 0): the loss alone skips
        assert "\n" not in message and message.startswith(
            "2 actor updates in a row were skipped for non-finite values, the last at step 3: the first non-finite "
            "value appeared in the log-probs (then in the loss"), message
        assert message.endswith(f"checkpointed in {run_dir / 'checkpoints' / 'step_000003'} (resume with "
                                "trainer.resume=auto once the cause is fixed)"), message
        rows = {}
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            row = json.loads(line)
            rows.setdefault(row.pop("step"), {}).update(row)
        assert sorted(rows) == [1, 2, 3, 4], layout
        assert [rows[step]["actor/update_skipped"] for step in sorted(rows)] == [0, 1, 1, 0], layout
        assert all(torch.isfinite(torch.tensor(rows[step]["actor/pg_loss"])) for step in (1, 4)), layout
        for rank in (0, 1):  # a skipped step leaves every rank's weights and optimizer state as they were
            states = {step: torch.load(run_dir / "checkpoints" / f"step_{step:06d}" / f"rank_{rank:05d}.pt",
                                       weights_only=False) for step in (1, 2, 3, 4)}
            same = {(a, b): all(torch.equal(states[a]["model"][name], states[b]["model"][name])
                                for name, value in states[a]["model"].items() if isinstance(value, torch.Tensor))
                    for a, b in ((1, 2), (2, 3), (3, 4))}
            assert same == {(1, 2): True, (2, 3): True, (3, 4): False}, (layout, rank)
            moments = [state["optimizer"][0]["torch"]["state"] for state in (states[1], states[3])]
            assert moments[0] and all(torch.equal(moments[0][key]["exp_avg"], moments[1][key]["exp_avg"])
                                      for key in moments[0]), (layout, rank)


def assert_loads_as_the_tiny_model(exported, original):
    """The checkpoint's Hugging Face export (both pipeline stages' layers, or one replica's) loads with every weight."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    reference = AutoModelForCausalLM.from_pretrained(original, dtype=torch.float32)
    reference_shapes = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == reference_shapes
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = torch.tensor([tokenizer.encode("Compute 1+2.")])
    assert torch.isfinite(model(ids).logits).all()
