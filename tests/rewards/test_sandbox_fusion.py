"""The SandboxFusion client (``reward.sandbox.mode=remote``) against a real loopback HTTP server that implements the
same ``POST /run_code`` API with our namespace sandbox behind it; config keys and verl's aliases."""
import json

import pytest

from megatron_cpo.config import load_config
from megatron_cpo.rewards import RewardConfig, RewardManager, compute_score
from megatron_cpo.rewards.sandbox import configure_sandbox, run_python
from megatron_cpo.rewards.sandbox_fusion import RemoteSandboxError
from megatron_cpo.rewards.sandbox_fusion_server import FusionCompatibleServer
from megatron_cpo.rewards.sandbox_namespaces import namespaces_unavailable_reason
from megatron_cpo.rewards.sandbox_types import SandboxConfig, SandboxLimits

BACKEND = "namespaces" if namespaces_unavailable_reason() is None else "process"
FAST = SandboxLimits(wall_timeout_s=5.0, cpu_time_s=1, memory_mb=256)
STDIO_TESTS = json.dumps({"inputs": ["1 2\n", "10 20\n", "-5 5\n"], "outputs": ["3\n", "30\n", "0\n"]})


@pytest.fixture(scope="module")
def server():
    running = FusionCompatibleServer(backend=BACKEND, python_executable=None if BACKEND == "namespaces"
                                     else "/usr/bin/python3").start()
    yield running
    running.close()


@pytest.fixture
def remote(server):
    configure_sandbox(SandboxConfig(mode="remote", fusion_url=server.url, fusion_max_concurrent=3,
                                      fusion_memory_limit_mb=256))
    yield server.url
    configure_sandbox(SandboxConfig(), resolve=False)


@pytest.mark.slow  # programs run by the sandbox behind the loopback server
def test_remote_runs_report_the_program_outcome(remote):
    ok = run_python("print(sum(map(int, input().split())))", "2 40\n", limits=FAST)
    assert (ok.status, ok.stdout, ok.returncode) == ("ok", "42\n", 0)
    assert run_python("raise ValueError", limits=FAST).status == "runtime_error"
    assert run_python("import time\ntime.sleep(30)", limits=SandboxLimits(wall_timeout_s=0.5)).status == "timeout"
    call = run_python("def add(a, b):\n    return a + b", "[1, 2]", limits=FAST, mode="call", fn_name="add")
    assert (call.status, call.stdout) == ("ok", "3")


@pytest.mark.slow  # programs run by the sandbox behind the loopback server
def test_remote_service_keeps_the_isolation(remote):
    program = ("import os\nfor path in ('/etc/shadow', f'/proc/{os.getppid()}/environ'):\n    try:\n"
               "        open(path).read()\n        print('read', path)\n    except OSError:\n        print('refused')")
    result = run_python(program, limits=FAST)
    assert result.stdout.split() == ["refused", "refused"]


@pytest.mark.slow  # programs run by the sandbox behind the loopback server
def test_code_grader_scores_right_through_the_remote_sandbox(remote):
    correct = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    wrong = "```python\na, b = map(int, input().split())\nprint(abs(a) + abs(b))\n```"
    assert compute_score("codecontests", correct, STDIO_TESTS, limits=FAST)["score"] == 1.0
    result = compute_score("apps", wrong, STDIO_TESTS, limits=FAST)
    assert result["score"] == pytest.approx(2 / 3) and result["test_statuses"] == ["passed", "passed",
                                                                                  "wrong_answer"]


@pytest.mark.slow  # programs run by the sandbox behind the loopback server
def test_reward_manager_workers_use_the_configured_remote_sandbox(server):
    settings = SandboxConfig(mode="remote", fusion_url=server.url, fusion_max_concurrent=2)
    correct = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    with RewardManager(RewardConfig(num_workers=1, sandbox=settings)) as manager:
        result = manager.score(["codecontests", "codecontests"], [correct, "```python\nprint(0)\n```"],
                               [STDIO_TESTS, STDIO_TESTS])
    assert result.scores.tolist() == [1.0, pytest.approx(1 / 3)]
    assert result.metrics["reward/sandbox_weak"] == 0.0
    configure_sandbox(SandboxConfig(), resolve=False)


@pytest.mark.slow  # programs run by the sandbox behind the loopback server
def test_service_errors_are_raised_not_scored(server):
    configure_sandbox(SandboxConfig(mode="remote", fusion_url=server.url.replace("run_code", "nothing")))
    try:
        with pytest.raises(RemoteSandboxError, match="HTTP 404"):
            run_python("print(1)", limits=FAST)
        configure_sandbox(SandboxConfig(mode="remote", fusion_url="http://127.0.0.1:9/run_code"))
        with pytest.raises(RemoteSandboxError, match="unreachable"):
            run_python("print(1)", limits=FAST)
    finally:
        configure_sandbox(SandboxConfig(), resolve=False)


def test_config_keys_and_verl_aliases(tmp_path):
    with pytest.raises(ValueError, match="reward.sandbox.mode=remote needs reward.sandbox.fusion_url"):
        SandboxConfig(mode="remote")
    path = tmp_path / "config.yaml"
    path.write_text("reward_model:\n  sandbox_fusion:\n    url: http://h:8080/run_code\n    max_concurrent: 8\n"
                    "reward:\n  sandbox:\n    mode: remote\n")
    config = load_config(str(path))
    assert config.reward.sandbox == SandboxConfig("remote", "http://h:8080/run_code", 8, 1024)
    ours = load_config(None, ["reward.sandbox_fusion.url=http://h:1/run_code",
                              "reward.sandbox.fusion_max_concurrent=3"])
    assert (ours.reward.sandbox.fusion_url, ours.reward.sandbox.fusion_max_concurrent) == ("http://h:1/run_code", 3)
