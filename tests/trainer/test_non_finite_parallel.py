"""A NaN in the log-probs of one micro-batch on one rank, in real two-process runs (PP=2, then DP=2; the same two
processes and one engine, as tests/trainer/test_e2e_parallel.py): the update of that step is skipped on both ranks
and the weights stay those of the last applied update, bit for bit on every rank; two skipped steps in a row end the
run (`actor_rollout_ref.actor.max_consecutive_skipped_updates=2`) with one line naming the log-probs as where the
first non-finite value appeared, checkpointed; resuming trains on. (A single skip followed by an applied update:
tests/trainer/test_non_finite.py.)

The NaN is put there by a hook that exists only in this test: it wraps `MegatronPolicy._log_probs_entropy` so that,
on global rank 1 (a DP replica that is not rank 0; with PP=2 the last stage, where the log-probs are), the first
micro-batch of the chosen updates' forward comes out NaN.
"""
import json
import os

import pytest
import torch

from tests.multiprocess import free_port, run_processes

LAYOUTS = {"pp2": 2, "dp2": 1}  # layout: pipeline_model_parallel_size (the other factor of the 2 ranks is DP)
POISONED_UPDATES = {2, 3}  # one optimizer step per training step here


def inject_nan_log_probs(updates: set[int]) -> dict:
    """The test's hook: NaN log-probs in the first micro-batch of each listed update (1-based, counted from the last
    time the returned state's "update" was set to 0) on global rank 1."""
    import torch.distributed as dist

    from megatron_cpo.trainer.workers.actor import MegatronPolicy

    real_update, real_log_probs = MegatronPolicy._update, MegatronPolicy._log_probs_entropy
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

    MegatronPolicy._update, MegatronPolicy._log_probs_entropy = counting_update, poisoned_log_probs
    return state


def train_both_layouts(rank, world_size, model_dir, data, run_dir, ports):
    """Per layout: a 3-step run with NaN log-probs at steps 2 and 3 (it stops after step 3), then the same run
    resumed to step 4 without them. Each run's process group meets on its own port."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from megatron_cpo.config import build_config
    from megatron_cpo.rollout.modes import build_rollout_manager
    from megatron_cpo.trainer.components import engine_launch_config
    from megatron_cpo.trainer.loop import run_training
    from megatron_cpo.trainer.run.errors import RunAbortedError

    def config(layout, pipeline_size, steps):
        return build_config({}, [
            f"actor_rollout_ref.model.path={model_dir}", f"data.train_files={data['train']}",
            "data.train_batch_size=2", "data.max_prompt_length=384", "data.max_response_length=8",
            "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=1e-2",
            f"actor_rollout_ref.actor.megatron.pipeline_model_parallel_size={pipeline_size}",
            "actor_rollout_ref.actor.max_consecutive_skipped_updates=2",
            "actor_rollout_ref.actor.checkpoint.save_contents=[model,optimizer,extra]",
            "actor_rollout_ref.rollout.ray_address=local", "reward.num_workers=1",
            "reward.custom_reward_function=tests.trainer.graders:even_first_character",
            f"trainer.total_training_steps={steps}", "trainer.save_freq=1", "trainer.val_before_train=false",
            f"trainer.default_local_dir={run_dir}/{layout}", "trainer.logger=[jsonl]"])

    counter = inject_nan_log_probs(POISONED_UPDATES)
    manager = None
    results, port = {}, iter(ports)
    try:
        for index, (layout, pipeline_size) in enumerate(LAYOUTS.items()):
            if manager is None and rank == 0:
                first = config(layout, pipeline_size, 3)
                manager = build_rollout_manager(first.actor_rollout_ref.rollout, engine_launch_config(first))
            if index:
                os.environ["MASTER_PORT"] = str(next(port))
            counter["update"] = 0
            try:
                run_training(config(layout, pipeline_size, 3), manager)
                results[layout] = "no error"
            except RunAbortedError as err:
                results[layout] = str(err)
            os.environ["MASTER_PORT"] = str(next(port))
            run_training(config(layout, pipeline_size, 4), manager)  # resumed from step 3; no update left to poison
    finally:
        if manager is not None:
            manager.shutdown()
    return results


@pytest.mark.timeout(1800)  # generous: the engine alone took ~10 min to start at load average 13-58 (shared 2 cores)
def test_nan_log_probs_on_one_rank_skip_the_update_everywhere_then_stop_the_run_and_resume_trains_on(
        tiny_model, arith_data, tmp_path):
    results = run_processes(train_both_layouts, 2, tiny_model, arith_data, str(tmp_path / "run"),
                            [free_port() for _ in range(3)], timeout=1500)
    for layout in LAYOUTS:
        run_dir = tmp_path / "run" / layout
        messages = {results[rank][layout] for rank in (0, 1)}
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
