"""The CPO comparison's bookkeeping: a paused and resumed run's CPU seconds per step leave its start-up out; the
on-policy distillation arms' and compare_lora.py's arms' commands load as the configs they mean; the distillation
report's samples to 90% of the teacher.

`benchmarks/real_model/compare_cpo.py` appends to a run's `step_cpu.jsonl` the process tree's CPU seconds at every
step row the trainer logs, and at the checkpoint manager's "resumed from ... (step k)" line of a resumed attempt;
`compare_cpo_report.step_cpu` turns those rows into cumulative CPU seconds per step. Real files, a real growing log.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "real_model"))
sys.path.insert(0, str(ROOT / "benchmarks" / "learning"))

from compare_cpo import RESUMED, NewLines  # noqa: E402
from compare_cpo_report import step_cpu  # noqa: E402


def test_new_lines_returns_each_complete_line_once(tmp_path):
    log = tmp_path / "console.log"
    log.write_text("before the attempt\n")
    lines = NewLines(log)
    assert lines.read() == []
    with log.open("a") as file:
        file.write("12:00 resumed from /runs/x/checkpoints/step_000005 (step 5)\npartial")
    assert lines.read() == ["12:00 resumed from /runs/x/checkpoints/step_000005 (step 5)"]
    with log.open("a") as file:
        file.write(" line\n")
    assert lines.read() == ["partial line"]
    assert lines.read() == []
    assert NewLines(tmp_path / "absent.log").read() == []


def test_new_lines_reads_on_after_the_file_is_rewritten_shorter(tmp_path):
    """A resumed trainer drops the rows logged past its checkpoint from metrics.jsonl, then logs the steps again;
    reading on from the old offset would start mid-line (how GRPO seed 2's CPU log stopped at its resume)."""
    from megatron_cpo.trainer.driver.loggers import JsonlSink

    path = tmp_path / "metrics.jsonl"
    sink = JsonlSink(path)
    for step in (1, 2, 3, 4):
        sink.log({"val/acc": 0.5}, step)
    sink.close()
    rows = NewLines(path)
    sink = JsonlSink(path, resume_step=2)  # the resumed attempt's logger at start-up
    assert rows.read() == []
    for step in (3, 4, 5):
        sink.log({"val/acc": 0.25, "timing/step_s": 61.0}, step)
    sink.close()
    assert [json.loads(line)["step"] for line in rows.read()] == [3, 4, 5]


def test_the_checkpoint_managers_resume_line_is_recognised():
    from megatron_cpo.trainer.run import checkpointing

    source = Path(checkpointing.__file__).read_text()
    assert 'logger.info("resumed from %s (step %d)", directory, step)' in source  # the line RESUMED reads
    match = RESUMED.search("07:40:02 resumed from runs/compare_cpo/cpo/seed1/checkpoints/step_000010 (step 10)")
    assert match and int(match.group(1)) == 10


def test_a_resumed_attempts_start_up_is_not_a_steps_cpu(tmp_path):
    rows = [{"step": 0, "attempt": 0, "tree_cpu_s": 100.0}, {"step": 1, "attempt": 0, "tree_cpu_s": 160.0},
            {"step": 2, "attempt": 0, "tree_cpu_s": 230.0},
            # attempt 1 resumes from step 1's checkpoint: 90 s of start-up, then step 2 again and step 3
            {"resumed": 1, "attempt": 1, "tree_cpu_s": 90.0}, {"step": 2, "attempt": 1, "tree_cpu_s": 155.0},
            {"step": 3, "attempt": 1, "tree_cpu_s": 215.0}]
    path = tmp_path / "step_cpu.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert step_cpu(path) == {1: 60.0, 2: 125.0, 3: 185.0}
    # an attempt whose log missed steps 4-5 (GRPO seed 2's, before the runner read on after a rewrite): no sum past 3
    with path.open("a") as file:
        for row in ({"resumed": 5, "attempt": 2, "tree_cpu_s": 40.0}, {"step": 6, "attempt": 2, "tree_cpu_s": 100.0}):
            file.write(json.dumps(row) + "\n")
    assert step_cpu(path) == {1: 60.0, 2: 125.0, 3: 185.0}


def test_the_curve_table_pairs_seeds_at_each_sample_count_interpolating_off_grid_validations():
    from compare_cpo_report import RunData, curve_table

    def run(arm, seed, points):  # points: (generated samples, accuracy) at each validation after step 0
        rows = {0: {"val/acc": 0.2}}
        rows.update({step: {"val/acc": acc, "train/generated_samples": samples}
                     for step, (samples, acc) in enumerate(points, start=1)})
        return RunData(arm, seed, True, rows, {step: 10.0 * step for step in rows if step})

    grid = [(320 * k, 0.2 + 0.05 * k) for k in range(1, 9)]
    runs = [run("grpo", 1, grid), run("grpo", 2, grid),
            run("cpo_grpo", 1, [(s, a + 0.02) for s, a in grid]), run("cpo_grpo", 2, [(s, a + 0.04) for s, a in grid]),
            # DAPO validates off the grid: 400 samples at 30%, 800 at 40%: 30% + 10 * (640 - 400) / 400 = 36% at 640
            run("dapo", 1, [(400, 0.3), (800, 0.4), (2700, 0.5)]),
            run("dapo", 2, [(400, 0.3), (800, 0.4), (2700, 0.5)])]
    table = curve_table(runs)
    assert table[0].startswith("| comparison | 320 | 640 |") and table[0].endswith("2,560 | mean over these |")
    cpo_row = next(line for line in table if line.startswith("| CPO on GRPO"))
    cells = [cell.strip() for cell in cpo_row.strip("|").split("|")][1:]
    assert len(cells) == 9 and all(cell.startswith("+3.0 [") for cell in cells)  # +2 and +4 points: mean +3
    dapo_row = next(line for line in table if line.startswith("| DAPO - GRPO"))
    at_640 = [cell.strip() for cell in dapo_row.strip("|").split("|")][2]
    assert at_640 == "+6.0 [+6.0, +6.0]"  # 36% against GRPO's 30% in both seeds
    assert not any(line.startswith("| CPO on DAPO") for line in table)  # no seed of cpo: no row


def test_the_distillation_arms_load_as_configs_with_their_teacher(tmp_path):
    """The OPD arms' commands are GRPO's config with distillation on: opd from the teacher's engine without the task
    reward, opd_task with it, opsd the policy given the gold solution, opsd_task with the task reward."""
    from compare_cpo import plan

    from megatron_cpo.config import load_config

    teacher = tmp_path / "teacher"
    configs = {}
    for run in plan(["opd", "opd_task", "opsd", "opsd_task", "grpo"], [2], 640, 320, 5, teacher=teacher):
        command = run.command()
        configs[run.arm] = load_config(command[command.index("--config") + 1], command[command.index("--config") + 2:])
    assert not configs["grpo"].distillation.enabled
    for arm, task_reward, kind in (("opd", False, "engines"), ("opd_task", True, "engines"), ("opsd", False, "self"),
                                     ("opsd_task", True, "self")):
        distillation = configs[arm].distillation
        assert distillation.enabled and distillation.distillation_loss.use_policy_gradient
        assert distillation.distillation_loss.use_task_rewards is task_reward
        assert distillation.teacher_models["teacher_model"].kind == kind
        assert configs[arm].actor_rollout_ref.rollout.temperature == 1.0 and configs[arm].trainer.resume == "auto"
    assert configs["opd"].distillation.teacher_models["teacher_model"].model_path == str(teacher)
    [variant] = plan(["opsd_task_c0.1_t0.7"], [2], 640, 320, 5, teacher=teacher)
    command = variant.command()
    config = load_config(command[command.index("--config") + 1], command[command.index("--config") + 2:])
    assert config.actor_rollout_ref.rollout.temperature == 0.7  # GRPO's, where opsd_task samples at 1
    assert config.distillation.distillation_loss.distillation_loss_coef == 0.1
    assert config.distillation.teacher_models["teacher_model"].kind == "self"
    assert config.distillation.distillation_loss.use_task_rewards and config.data.hint_instruction


def test_the_lora_arms_load_as_their_configs_and_the_higher_rate_arm_changes_only_the_rate():
    """compare_lora.py's arms: rank 32 and rank 1 at 1e-4, and `lora_r32_lr3e-4` / `lora_r1_lr3e-4` their configs at
    3e-4 (an arm's overrides come after the comparison's own keys, so they win)."""
    from compare_cpo import plan
    from compare_lora import LORA

    from megatron_cpo.config import load_config

    configs = {}
    for run in plan(list(LORA.arms), [1], 640, 320, 5, comparison=LORA):
        command = run.command()
        configs[run.arm] = load_config(command[command.index("--config") + 1], command[command.index("--config") + 2:])
    assert configs["grpo"].actor_rollout_ref.model.lora.rank == 0
    assert configs["grpo"].actor_rollout_ref.actor.optim.lr == 1e-5
    for arm, rank, lr in (("lora_r32", 32, 1e-4), ("lora_r1", 1, 1e-4), ("lora_r32_lr3e-4", 32, 3e-4),
                             ("lora_r1_lr3e-4", 1, 3e-4)):
        assert configs[arm].actor_rollout_ref.model.lora.rank == rank, arm
        assert configs[arm].actor_rollout_ref.actor.optim.lr == lr, arm
    assert configs["lora_r32_lr3e-4"].trainer.seed == configs["lora_r1_lr3e-4"].trainer.seed == 1


def test_the_opd_report_finds_the_samples_to_90_percent_of_the_teacher_bounds_a_grpo_that_never_got_there_and_pairs():
    from compare_cpo_report import RunData
    from compare_opd_report import crossing, report

    assert crossing([(0, 20.0), (320, 43.0), (640, 65.5), (960, 70.0)], 66.15) == pytest.approx(640 + 320 * 0.65 / 4.5)
    assert crossing([(0, 20.0), (320, 50.0)], 20.0) == 0 and crossing([(0, 20.0), (320, 50.0)], 60.0) is None

    def run(arm, seed, accuracies):  # one validation every 320 samples, 10 CPU s a step
        rows = {0: {"val/acc": accuracies[0] / 100}}
        rows.update({step: {"val/acc": acc / 100, "train/generated_samples": 320.0 * step}
                     for step, acc in enumerate(accuracies[1:], start=1)})
        return RunData(arm, seed, True, rows, {step: 10.0 * step for step in rows if step})

    runs = [run("grpo", 1, [20, 40, 60, 80]), run("grpo", 2, [20, 30, 40, 50]),
            run("opd", 1, [20, 80, 80, 80]), run("opd", 2, [20, 70, 90, 90])]
    text = report(runs, teacher=80.0)  # 90% of it: 72%
    assert "| opd | 1,2 | 20.0 | 75.0 | 85.0 | 85.0 |" in text
    # GRPO seed 1 crosses 72% at 640 + 320 * 12 / 20 = 832; OPD seed 1 at 320 * 52 / 60 = 277, 0.33x; seed 2 at
    # 320 + 320 * 2 / 20 = 352, and GRPO seed 2 never crosses by 960: below 352 / 960 = 0.37x
    assert "| grpo | 832 | > 960 |" in text
    assert "| opd | 277 (0.33x) | 352 (< 0.37x) |" in text
    # minus GRPO by seed: +40 and +40 at 320, +20 and +50 at 640, 0 and +40 at 960 (t_{0.975,1} = 12.706)
    assert "| opd | 1,2 | +40.0 [+40.0, +40.0] | +35.0 [-155.6, +225.6] | +20.0 [-234.1, +274.1] |" in text
    assert "| opd | no seed in common with GRPO |" in report([runs[0], run("opd", 2, [20, 70, 90, 90])], 80.0)


def write_run(directory: Path, accuracies: list[float], *, finished: bool = True, peak: float | None = None,
              update_s: float = 60.0, machine: dict | None = None) -> None:
    """A run directory as compare_cpo.execute leaves it: one validation every 320 samples (step k has generated
    320 k), 10 CPU s a step, the trainer's peak on every step row, the attempt's machine."""
    directory.mkdir(parents=True)
    rows = [{"step": 0, "val/acc": accuracies[0] / 100}]
    rows += [{"step": step, "val/acc": acc / 100, "train/generated_samples": 320.0 * step,
              "timing/update_actor_s": update_s, "timing/weight_sync_s": 2.5}
             for step, acc in enumerate(accuracies[1:], start=1)]
    (directory / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (directory / "step_cpu.jsonl").write_text("".join(
        json.dumps({"step": row["step"], "attempt": 0, "tree_cpu_s": 10.0 * row["step"], "trainer_peak_rss_gib": peak})
        + "\n" for row in rows))
    attempt = {"returncode": 0 if finished else -15, **({"machine": machine} if machine else {})}
    (directory / "run.json").write_text(json.dumps({"finished": finished, "budget": 640, "attempts": [attempt]}))


def test_a_finished_run_is_archived_and_the_lora_report_pairs_it_with_seeds_archived_on_another_machine(tmp_path):
    """A finished run's record, metrics and per-step CPU are copied to `results/<comparison><budget>/<arm>/seed<k>/`;
    the LoRA report reads the live runs first and the archive after, so a seed measured by an earlier session (on
    another CPU) pairs with one measured now, and says which CPU each run's timings come from."""
    from dataclasses import replace

    from compare_cpo import ARCHIVED, archive, plan
    from compare_lora import LORA
    from compare_lora_report import report
    from machine import CPU_FLAGS, machine_record

    here = machine_record()
    assert set(here["cpu_flags"]) <= set(CPU_FLAGS) and here["cores"] >= 1
    lora = replace(LORA, runs=tmp_path / "runs")
    [full_now] = plan(["grpo"], [3], 640, 320, 5, comparison=lora)
    write_run(full_now.out_dir, [20.0, 40.0, 60.0], peak=6.0, update_s=90.0, machine=here)
    archived = archive(full_now, results=tmp_path / "results")
    assert archived == tmp_path / "results" / "compare_lora640" / "grpo" / "seed3"
    assert all((archived / name).read_bytes() == (full_now.out_dir / name).read_bytes() for name in ARCHIVED)

    avx2 = {"cpu": "AMD EPYC", "cpu_flags": ["avx2"], "cores": 2, "ONEDNN_MAX_CPU_ISA": ""}
    results = tmp_path / "results" / "compare_lora640"
    write_run(results / "lora_r32_lr3e-4" / "seed3", [20.0, 45.0, 63.0], peak=4.5, update_s=70.0, machine=avx2)
    write_run(results / "grpo" / "seed2", [20.0, 30.0, 50.0], peak=6.2, machine=avx2)
    write_run(results / "lora_r32_lr3e-4" / "seed2", [20.0, 35.0, 56.0], peak=4.9, machine=avx2)
    # a stopped run in the live directory does not hide the archived, finished one of the same seed
    write_run(lora.runs / "lora_r32_lr3e-4" / "seed2", [20.0, 99.0], finished=False)
    write_run(results / "lora_r1_lr3e-4" / "seed4", [20.0, 30.0, 50.0], peak=4.4)  # no full fine-tuning seed 4
    text = report([lora.runs, results])
    assert "| grpo (2 seeds) | 20.0 | 35.0 | 55.0 |" in text
    assert "| lora_r32_lr3e-4 (2 seeds) | 20.0 | 40.0 | 59.5 |" in text
    assert "- lora_r32_lr3e-4 - grpo: +4.5 " in text and "over seeds [2, 3]" in text
    assert "| lora_r32_lr3e-4 | 4.70 | 77% |" in text  # 4.70 of 6.10 GiB
    assert "- lora_r1_lr3e-4 - grpo: no seed in common (lora_r1_lr3e-4: [4], grpo: [2, 3])" in text
    assert "grpo/seed2 AMD EPYC (avx2, 2 cores)" in text and f"grpo/seed3 {here['cpu']}" in text
