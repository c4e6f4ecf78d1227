"""Helpers of the engine tests: start a `megatron-cpo rollout` process, end it, check that engines generate exactly
what transformers computes for a model directory, and that a training run's engine served every pushed weight."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

PROMPTS = [[1, 40, 41, 42], [1, 60, 70, 80, 90], [1, 33, 3]]


def start_server(model_dir, work_dir: Path, name: str, token_file: Path) -> subprocess.Popen:
    """A rollout server in its own session (so the test can kill its whole process tree)."""
    log = open(work_dir / f"{name}.log", "wb")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
    process = subprocess.Popen([sys.executable, "-m", "megatron_cpo.cli", "rollout", "--model", str(model_dir),
                                "--dtype", "float32", "--max-model-len", "512", "--port", "0",
                                "--token-file", str(token_file), "--ready-file", str(work_dir / f"{name}.url")],
                               env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return process


def wait_url(process: subprocess.Popen, work_dir: Path, name: str, timeout_s: float = 600) -> str:
    ready = work_dir / f"{name}.url"
    deadline = time.monotonic() + timeout_s
    while not ready.exists():
        assert process.poll() is None, (work_dir / f"{name}.log").read_text()[-3000:]
        assert time.monotonic() < deadline, f"server {name} did not start in {timeout_s}s"
        time.sleep(0.2)
    return ready.read_text().strip()


def end_server(process: subprocess.Popen, sig: int = signal.SIGTERM, timeout_s: float = 60) -> None:
    """Send `sig` to the server (SIGKILL: to its whole process tree at once, a crash), then kill whatever of its
    process tree outlives `timeout_s`."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.Error:
        tree = []
    for proc in tree if sig == signal.SIGKILL else tree[:1]:
        try:
            proc.send_signal(sig)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(tree, timeout=timeout_s)
    for proc in alive:
        proc.kill()
    psutil.wait_procs(alive, timeout=10)


def assert_engine_in_sync(metrics: dict[int, dict], steps, require_change: bool = True) -> bool:
    """A run's metric rows (by step): after every push the engine's log-probs, of its samples and of the sync probe,
    equal the trainer's (float32 noise). Returns whether the weights changed in between (so a stale engine could not
    hide); with `require_change` that must be so."""
    for step in steps:
        row = metrics[step]
        assert row["mismatch/log_probs_diff_max"] < 1e-4 and row["rollout/sync_check_max_abs_diff"] < 1e-4, (step, row)
    changed = any(metrics[step]["actor/grad_norm"] > 0 for step in steps)
    assert changed or not require_change, "no step changed the weights"
    return changed


def greedy_matches_transformers(manager, model_dir) -> float:
    """Greedy tokens of every prompt equal transformers' argmax for `model_dir`; returns the largest log-prob gap."""
    from transformers import AutoModelForCausalLM

    from megatron_cpo.rollout import SamplingParams

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for index, prompt in enumerate(PROMPTS):
        manager.submit(f"check-{index}", prompt, SamplingParams(temperature=0.0, max_tokens=8))
    groups = list(manager.completed(timeout=120))
    assert len(groups) == len(PROMPTS)
    worst = greedy_log_prob_gap(model, groups)
    assert worst < 1e-4
    return worst


def greedy_log_prob_gap(model, groups) -> float:
    """Each group's greedy sample is `model`'s argmax token by token; returns the largest |engine - model| log-prob
    gap over the sampled tokens."""
    worst = 0.0
    for group in groups:
        sample = group.samples[0]
        tokens = torch.tensor([group.prompt_token_ids + sample.token_ids])
        with torch.no_grad():
            log_probs = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
        positions = torch.arange(len(group.prompt_token_ids) - 1, tokens.shape[1] - 1)
        assert log_probs[positions].argmax(-1).tolist() == sample.token_ids
        gap = (log_probs[positions, torch.tensor(sample.token_ids)] - torch.tensor(sample.logprobs)).abs().max()
        worst = max(worst, gap.item())
    return worst
