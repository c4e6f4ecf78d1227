"""Resuming asynchronous training after kill -9: prompts in flight at the checkpoint are generated again, none is
lost or trained twice (NeMo-RL lost them on resume, its issue #3599). The killed attempt is a real
`python -m megatron_cpo.trainer` job (its own engine, Ray cluster and grading pool, all killed with -9); the resume
runs in-process on the session's engine."""
import json
from pathlib import Path

import pytest

from megatron_cpo.config import load_config
from megatron_cpo.trainer.assemble import run_training
from tests.trainer.test_run_recovery import EXAMPLE, TrainProcess, latest, logged_steps, rows

pytestmark = [pytest.mark.usefixtures("restore_environment"), pytest.mark.slow]


def trained_prompts(run_dir: Path) -> list[list[str]]:
    """Each step's trained prompts, in batch order, from completions.jsonl (every response is logged)."""
    by_step: dict[int, list[str]] = {}
    for row in map(json.loads, (run_dir / "completions.jsonl").read_text().splitlines()):
        prompts = by_step.setdefault(row["step"], [])
        if row["prompt"] not in prompts:
            prompts.append(row["prompt"])
    return [by_step[step] for step in sorted(by_step)]


def epoch_prompts(config) -> list[str]:
    """The prompts of the run's first epoch, in the order its data stream yields them."""
    from transformers import AutoTokenizer

    from megatron_cpo.data.dataset import PromptDataset
    from megatron_cpo.trainer.driver.prompt_stream import PromptStream

    tokenizer = AutoTokenizer.from_pretrained(config.actor_rollout_ref.model.path)
    dataset = PromptDataset(config.data.train_files, tokenizer, config.data,
                            needs_ground_truth=config.reward.needs_ground_truth)
    stream = PromptStream(dataset, 1, config.trainer.seed, config.data.shuffle)
    return [record.messages[-1]["content"] for _, record in iter(stream.next, None)]


def test_resume_after_kill_trains_every_prompt_once(small_run_overrides, rollout_manager, tmp_path):
    """k = 1, a checkpoint every 2 steps: the job is killed with -9 while it generates after step 2's checkpoint
    (the next steps' prompts in flight), resumed to step 6; the trained prompts are then the epoch's first 24, in
    order, each once."""
    run_dir = tmp_path / "run"
    run = [*small_run_overrides, "trainer.total_training_steps=6", "trainer.save_freq=2",
           "trainer.val_before_train=false", "async_training.max_staleness=1", "trainer.log_completions=8"]
    job = TrainProcess.pausing([*run, "actor_rollout_ref.rollout.ray_address=local"], tmp_path / "job", run_dir,
                               after_steps=(2,))
    try:
        job.wait_until_paused(after_step=2)
    finally:
        job.kill_all()
    assert latest(run_dir) == "step_000002" and max(logged_steps(run_dir)) in (2, 3)
    assert rows(run_dir)[2]["async/in_flight"] + rows(run_dir)[2]["async/buffered_groups"] > 0

    run_training(load_config(EXAMPLE, [*run, "trainer.resume=auto"]), rollout_manager)
    assert logged_steps(run_dir) == [1, 2, 3, 4, 5, 6]
    steps = trained_prompts(run_dir)
    assert [len(prompts) for prompts in steps] == [4] * 6
    assert [p for prompts in steps for p in prompts] == epoch_prompts(load_config(EXAMPLE, run))[:24]
