"""What reaches the console: known library noise goes to the log file only, the trainer's own messages and unknown
warnings reach the console, the training bar has an ETA, grading workers exit quietly when the trainer dies, and a
requested metric sink whose package is missing stops the run at start with the install line."""
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_cpo.progress import eta_seconds, format_duration
from megatron_cpo.trainer.driver.loggers import ConsoleSink, MetricLogger

ROOT = Path(__file__).resolve().parents[2]


def run_python(code: str, tmp_path: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=timeout)


def test_library_noise_goes_to_the_log_file_only(tmp_path):
    """Real torch warnings (the non-leaf `.grad` access and a deprecated c10d collective, both raised by torch
    itself), a Megatron-Core INFO record with the bucket dump's text, an unknown warning and our own message."""
    done = run_python("""
        import logging, warnings
        import torch, torch.distributed as dist
        from megatron_cpo.console import setup_logging
        setup_logging("run/train.log")
        (torch.ones(2, requires_grad=True) * 2).grad
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        out = torch.zeros(2)
        dist.reduce_scatter_tensor(out, torch.ones(2))
        dist.destroy_process_group()
        logging.getLogger("megatron.core.distributed.param_and_grad_buffer").info(
            "Number of buckets for gradient all-reduce / reduce-scatter: 1\\nParams for bucket 1 (10 elements):")
        warnings.warn("an unexpected library warning", UserWarning)
        logging.getLogger("megatron_cpo.trainer.assemble").info("building the Megatron actor")
    """, tmp_path)
    assert done.returncode == 0, done.stderr
    log = (tmp_path / "run" / "train.log").read_text()
    for text in ("is not a leaf Tensor", "reduce_scatter_tensor` is deprecated", "Params for bucket 1",
                 "an unexpected library warning", "building the Megatron actor"):
        assert text in log, text
    for text in ("is not a leaf Tensor", "is deprecated", "Params for bucket", "Number of buckets"):
        assert text not in done.stderr, done.stderr
    assert "an unexpected library warning" in done.stderr and "building the Megatron actor" in done.stderr


def test_log_file_follows_its_path_when_the_run_directory_is_moved_away(tmp_path):
    """An earlier run's directory archived at start-up (renamed) must not take this run's log with it."""
    done = run_python("""
        import logging, os
        from megatron_cpo.console import setup_logging
        setup_logging("run/train.log")
        log = logging.getLogger("megatron_cpo.trainer.assemble")
        log.info("before the move")
        os.rename("run", "run.archived")
        log.info("after the move")
    """, tmp_path)
    assert done.returncode == 0 and "Logging error" not in done.stderr, done.stderr
    assert "before the move" in (tmp_path / "run.archived" / "train.log").read_text()
    assert "after the move" in (tmp_path / "run" / "train.log").read_text()


def test_grading_worker_exits_quietly_when_the_trainer_dies(tmp_path):
    """A trainer that dies without closing its grader pool (an error exit) used to leave each worker printing a
    ConnectionResetError/EOFError traceback on the same terminal."""
    done = run_python("""
        import os
        from megatron_cpo.rewards.pool import GraderPool
        pool = GraderPool(1, {}, None, {})
        outcome, = pool.run([("megatron_cpo/arith", "\\\\boxed{3}", "3", None)], timeout_s=60)
        print(outcome.status, flush=True)
        os._exit(1)
    """, tmp_path)
    assert done.returncode == 1 and done.stdout.strip() == "ok", done.stderr
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr


@pytest.mark.slow  # a fresh interpreter importing torch, Megatron-Core and vLLM
def test_help_of_every_command_prints_nothing_but_the_help(tmp_path):
    """`megatron-cpo [<command>] --help` in a fresh interpreter, where Megatron-Core's import-time announcements
    ("Transformer Engine and Apex are not installed", eight lines) used to come before the help."""
    from megatron_cpo.cli import COMMANDS

    done = run_python("""
        from megatron_cpo.cli import COMMANDS, main
        for name in ["", *COMMANDS]:
            try:
                main([name, "--help"] if name else ["--help"])
            except SystemExit as exit:
                assert exit.code == 0, (name, exit.code)
    """, tmp_path)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert all(f"usage: megatron-cpo {name} " in done.stdout for name in COMMANDS), done.stdout


def test_eta_and_durations():
    assert eta_seconds(0, 10, 5.0) is None
    assert eta_seconds(2, 10, 30.0) == pytest.approx(120.0)
    assert eta_seconds(12, 10, 30.0) == 0
    assert [format_duration(s) for s in (0, 42.4, 65, 3600 + 125)] == ["0 s", "42 s", "1 min 05 s", "1 h 02 min"]


def test_console_bar_shows_an_eta_until_the_last_step(tmp_path):
    out = tmp_path / "console.txt"
    with out.open("w") as stream:
        sink = ConsoleSink(total_steps=4, stream=stream)
        for step in range(0, 5):
            sink.log({"reward/mean": 0.5}, step)
    lines = out.read_text().splitlines()
    assert "ETA ?" in lines[0] and all(" ETA " in line for line in lines[1:4]), lines
    assert "ETA" not in lines[4] and lines[4].startswith("[####################] step 4/4")


@pytest.mark.parametrize("sink, install", [("wandb", "pip install wandb"), ("tensorboard", "pip install tensorboard")])
def test_a_requested_sink_without_its_package_is_an_error_at_start(tmp_path, monkeypatch, sink, install):
    """The package is made unimportable for this test (sys.modules[name] = None), whether or not it is installed."""
    from megatron_cpo.config import load_config
    from megatron_cpo.trainer.assemble import run_training

    monkeypatch.setitem(sys.modules, sink, None)
    with pytest.raises(ValueError, match=f"trainer.logger includes '{sink}' but .* not installed; {install}"):
        MetricLogger(["console", sink], tmp_path, 4, "project", "run", {})
    config = load_config(str(ROOT / "examples" / "tiny" / "grpo_arith.yaml"),
                         [f"trainer.logger=[console,{sink}]", f"trainer.default_local_dir={tmp_path}"])
    with pytest.raises(ValueError, match=install):
        run_training(config)  # before torch.distributed, Ray or any engine starts


def test_tensorboard_sink_writes_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="the tools extra installs tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    metrics = MetricLogger(["tensorboard"], tmp_path, 2, "project", "run", {})
    metrics.log({"reward/mean": 0.25}, 1)
    metrics.log({"reward/mean": 0.75}, 2)
    metrics.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.25), (2, 0.75)]
