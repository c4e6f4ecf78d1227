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


def push_interrupts_greedy_groups_without_changing_them(manager, model_dir, in_flight: str) -> None:
    """Greedy groups that are generating while the engines take a push of the very weights they hold (`in_flight`
    says how: finish / partial / keep) come out token for token as uninterrupted ones, and each token carries the
    version that sampled it: the old one only (`finish`), or the old then the new one (`partial`, `keep`: at least
    one sample must have been caught mid-way). The push starts once a one-token request sent after the long ones has
    returned, so the long ones were generating by then. A `partial` push is finished as the trainer does before its
    sync probe (`resume=False`): the probe runs while the aborted samples wait, and for as long again as the whole
    uninterrupted run took no sample goes on (a group that finishes meanwhile has no token of the new version);
    `resume_generation` lets them go on."""
    from transformers import AutoModelForCausalLM

    from megatron_cpo.rollout import SamplingParams

    state = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    manager.sync_weights(state.items())  # a known state (other tests push other weights into shared engines)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=400)
    straight_s = None

    def generate(tag: str, push: bool) -> dict:
        for index, prompt in enumerate(PROMPTS):
            manager.submit(f"{tag}-{index}", prompt, params)
        groups = {}
        if push:
            manager.submit(f"{tag}-probe", PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=1))
            while f"{tag}-probe" not in groups:
                groups.update((group.request_id, group) for group in manager.finished(timeout=120))
            hold = in_flight == "partial"
            manager.sync_weights(state.items(), in_flight=in_flight, resume=not hold)
            if hold:
                assert manager.sync_probe([PROMPTS[0]], 8), "the sync probe got no answer with samples held"
                groups.update((group.request_id, group) for group in finished_until_quiet(manager, straight_s))
                assert all(set(sample.policy_versions) <= {manager.weight_version - 1}
                           for group in groups.values() for sample in group.samples), \
                    "a held sample went on before resume_generation"
                manager.resume_generation()
        groups.update((group.request_id, group) for group in manager.completed(timeout=300))
        groups.pop(f"{tag}-probe", None)
        return groups

    before = manager.weight_version
    started = time.perf_counter()
    straight = generate(f"straight-{in_flight}", push=False)
    straight_s = time.perf_counter() - started
    assert manager.weight_version == before
    # Over HTTP the push can land before an engine has sampled a first token (then nothing spans it, and the
    # attempt shows only that the tokens are unchanged): up to three attempts to catch a sample mid-way.
    for attempt in range(3):
        old = manager.weight_version
        tag = f"interrupted-{in_flight}-{attempt}"
        interrupted = generate(tag, push=True)
        assert manager.weight_version == old + 1
        spanning = 0
        for index in range(len(PROMPTS)):
            for plain, pushed in zip(straight[f"straight-{in_flight}-{index}"].samples,
                                     interrupted[f"{tag}-{index}"].samples):
                assert pushed.token_ids == plain.token_ids and pushed.finish_reason == plain.finish_reason
                assert torch.allclose(torch.tensor(pushed.logprobs), torch.tensor(plain.logprobs), atol=1e-4)
                assert plain.policy_versions == [before] * len(plain.token_ids)
                versions = pushed.policy_versions
                assert len(versions) == len(pushed.token_ids) and versions == sorted(versions)
                assert set(versions) <= {old, old + 1}
                spanning += len(set(versions)) == 2
        if in_flight == "finish":
            assert spanning == 0
            return
        if spanning:
            return
    raise AssertionError("no sample was generating when the weights were pushed, in 3 attempts")


def finished_until_quiet(manager, quiet_s: float) -> list:
    """The groups that finish until none has for `quiet_s` seconds (or none is outstanding)."""
    groups = []
    try:
        while finished := manager.finished(timeout=quiet_s):
            groups += finished
    except TimeoutError:
        pass
    return groups
