"""The weak ``process`` backend and how a backend is chosen.

The process backend is not a boundary (the host's filesystem stays in view, which the first test shows), so it must
only run when chosen knowingly or when nothing better exists, and then say so loudly: a warning and
``reward/sandbox_weak``. As root it still gives each run a fresh uid and kills every process of that uid afterwards,
so a double-forked daemon does not survive it either. The interpreter must be runnable by that uid: this machine's
venv interpreter lives under ``/root`` (mode 0700), so these tests use the system ``/usr/bin/python3``.
"""
import logging
import os
import subprocess
import sys

import psutil
import pytest

from megatron_cpo.rewards import sandbox
from megatron_cpo.rewards.sandbox import configure_sandbox, run_python
from megatron_cpo.rewards.sandbox_types import SandboxConfig, SandboxLimits

SYSTEM_PYTHON = "/usr/bin/python3"
pytestmark = [pytest.mark.skipif(not os.access(SYSTEM_PYTHON, os.X_OK), reason=f"no {SYSTEM_PYTHON} here"),
              pytest.mark.slow]  # sandboxed interpreters, the backend probe
LIMITS = SandboxLimits(wall_timeout_s=5.0, cpu_time_s=1, memory_mb=256, python_executable=SYSTEM_PYTHON)


def test_process_mode_grades_and_is_visibly_weak():
    result = run_python("print(sum(map(int, input().split())))", "2 40\n", limits=LIMITS, backend="process")
    assert (result.status, result.stdout) == ("ok", "42\n")
    listing = run_python("import os\nprint(sorted(os.listdir('/')))", limits=LIMITS, backend="process")
    assert "'etc'" in listing.stdout, "process mode shows the host filesystem: it is not an isolation boundary"


@pytest.mark.skipif(os.geteuid() != 0, reason="a fresh uid per run needs root")
def test_process_mode_kills_a_setsid_daemon_and_protects_root_files(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("do-not-leak")
    secret.chmod(0o600)
    program = ("import os, time\n"
               f"try:\n    print(open({str(secret)!r}).read())\nexcept OSError as e:\n    print('refused', e.errno)\n"
               "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n        time.sleep(60)\n    os._exit(0)")
    result = run_python(program, limits=LIMITS, backend="process")
    assert result.stdout.strip() == "refused 13"
    strays = [p.pid for p in psutil.process_iter(["uids", "status"])
              if p.info["uids"] and p.info["uids"].real >= 100_000_000 and p.info["status"] != psutil.STATUS_ZOMBIE]
    assert strays == []


@pytest.fixture
def restore_settings():
    yield
    configure_sandbox(SandboxConfig(), resolve=False)


def test_choosing_process_mode_warns_and_sets_the_metric(caplog, restore_settings):
    sandbox._resolve.cache_clear()
    with caplog.at_level(logging.WARNING, logger="megatron_cpo.rewards.sandbox"):
        assert configure_sandbox(SandboxConfig(mode="process")) == "process"
    assert "CODE SANDBOX IS WEAK" in caplog.text
    assert sandbox.sandbox_metrics() == {"reward/sandbox_weak": 1.0}


def test_auto_picks_the_strongest_backend_and_logs_it(caplog, restore_settings):
    sandbox._resolve.cache_clear()
    expected = "namespaces" if sandbox.namespaces_unavailable_reason() is None else "process"
    with caplog.at_level(logging.INFO, logger="megatron_cpo.rewards.sandbox"):
        assert configure_sandbox(SandboxConfig(mode="auto")) == expected
        assert configure_sandbox(SandboxConfig(mode="auto", fusion_url="http://127.0.0.1:1/run_code")) == "remote"
    assert f"runs the '{expected}' backend" in caplog.text and "runs the 'remote' backend" in caplog.text
    assert sandbox.sandbox_metrics() == {"reward/sandbox_weak": 0.0}


def test_settings_are_validated():
    with pytest.raises(ValueError, match="reward.sandbox.mode='chroot'"):
        SandboxConfig(mode="chroot")
    with pytest.raises(ValueError, match="reward.sandbox.fusion_url"):
        SandboxConfig(mode="remote")


def test_where_namespaces_are_refused_auto_falls_back_loudly_and_namespaces_mode_is_an_error():
    """Inside a fresh user namespace without a uid map (like an unprivileged container) the sandbox cannot switch to
    its unprivileged uid: the namespace backend's trial run fails, ``auto`` resolves to ``process`` with the
    warning, and an explicit ``namespaces`` is an error that names the alternatives; nothing falls back silently."""
    script = ("import ctypes, os\n"
              "assert ctypes.CDLL(None, use_errno=True).unshare(0x10000000) == 0, 'no user namespaces here'\n"
              "from megatron_cpo.rewards.sandbox import configure_sandbox, SandboxConfig\n"
              "print(configure_sandbox(SandboxConfig(mode='auto')))\n"
              "try:\n    configure_sandbox(SandboxConfig(mode='namespaces'))\n"
              "except RuntimeError as error:\n    print('refused:', error)\n")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert child.returncode == 0, child.stderr
    lines = child.stdout.splitlines()
    assert lines[0] == "process" and "CODE SANDBOX IS WEAK" in child.stderr
    assert lines[1].startswith("refused: reward.sandbox.mode=namespaces, but this machine refuses them")
    assert "reward.sandbox.mode=remote" in lines[1]
