"""`reward.remote.*` end to end: the trainer's grading path (`ResponseScorer.score_groups` with the reward manager of
the config's `reward.*`) against the reference reward server run as its own process on loopback (real HTTP), healthy,
down and too slow."""
import selectors
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from megatron_cpo.config import build_config
from megatron_cpo.data.dataset import PromptRecord
from megatron_cpo.rewards import ARITH_DATA_SOURCE, RemoteRewardError
from megatron_cpo.trainer.driver.grading import ResponseScorer

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL = ROOT / "examples" / "tiny" / "model"
SCORERS = Path(__file__).resolve().parent / "remote_scorers.py"


def start_server(*arguments):
    """`python -m megatron_cpo.rewards.reward_server --port 0 ...`; returns (process, url) once it listens."""
    process = subprocess.Popen([sys.executable, "-m", "megatron_cpo.rewards.reward_server", "--port", "0",
                                *arguments], stdout=subprocess.PIPE, text=True)
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        line = process.stdout.readline() if selector.select(timeout=120) else ""
    if "http://" not in line:
        process.kill()
        raise RuntimeError(f"reference reward server did not start: {line!r}")
    return process, line.split()[-1]


def stop_server(process):
    process.terminate()
    process.wait(timeout=30)
    process.stdout.close()


@pytest.fixture(scope="module")
def verifiable_server():
    process, url = start_server()
    yield url
    stop_server(process)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def grade(tokenizer, overrides, answers=("4", "5")):
    """Grade one group of responses to "2+2?" (gold 4) through the trainer's path; returns (scores, acc, the
    remote metrics the step logs)."""
    config = build_config({}, ["reward.num_workers=1", *overrides])
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    record = PromptRecord(uid="0-0", index=0, messages=[{"role": "user", "content": "2+2?"}], prompt_ids=prompt_ids,
                          data_source=ARITH_DATA_SOURCE, ground_truth="4")
    responses = [tokenizer.encode(f"\\boxed{{{answer}}}", add_special_tokens=False) for answer in answers]
    scorer = ResponseScorer(config.reward, tokenizer)
    try:
        [(scores, acc, _)] = scorer.score_groups([(record, responses)])
        return scores, acc, scorer.counted_metrics()
    finally:
        scorer.close()


def test_remote_scores_replace_or_add_to_the_rule_scores(verifiable_server, tokenizer):
    remote = ["reward.remote.enable=true", f"reward.remote.url={verifiable_server}"]
    # the reference server grades megatron_cpo/arith like the rule grader: +1 right, -1 wrong
    scores, acc, metrics = grade(tokenizer, remote)
    assert scores.tolist() == [1.0, -1.0] and acc.tolist() == [1.0, 0.0]
    assert metrics["reward/remote/failed"] == 0 and metrics["reward/remote/score_mean"] == 0.0
    scores, acc, _ = grade(tokenizer, [*remote, "reward.remote.combine=add"])
    assert scores.tolist() == [2.0, -2.0] and acc.tolist() == [1.0, 0.0]
    scores, _, metrics = grade(tokenizer, [])
    assert scores.tolist() == [1.0, -1.0] and metrics == {"reward/non_finite": 0.0}


def test_the_model_reads_the_prompt_the_policy_saw(tokenizer):
    process, url = start_server("--scorer", f"{SCORERS}:prompt_length")
    try:
        scores, _, _ = grade(tokenizer, ["reward.remote.enable=true", f"reward.remote.url={url}"], answers=("4",))
    finally:
        stop_server(process)
    prompt_ids = tokenizer.apply_chat_template([{"role": "user", "content": "2+2?"}], add_generation_prompt=True)
    prompt = tokenizer.decode(prompt_ids, skip_special_tokens=False)
    assert "2+2?" in prompt and len(prompt) > len("2+2?")  # the chat template is part of it
    assert scores.tolist() == pytest.approx([len(prompt) / 1000])


def test_a_server_that_is_down_fails_naming_the_url_or_scores_the_failure(tokenizer):
    process, url = start_server()
    stop_server(process)  # its port is now closed
    down = ["reward.remote.enable=true", f"reward.remote.url={url}", "reward.remote.max_retries=1",
            "reward.remote.backoff_s=0.01"]
    with pytest.raises(RemoteRewardError, match=f"reward model at {url}/score failed 2 attempts"):
        grade(tokenizer, down)
    scores, acc, metrics = grade(tokenizer, [*down, "reward.remote.on_error=failure_score",
                                             "reward.remote.failure_score=-3"])
    assert scores.tolist() == [-3.0, -3.0] and acc.tolist() == [1.0, 0.0]
    assert metrics["reward/remote/failed"] == 2
    scores, _, _ = grade(tokenizer, [*down, "reward.remote.on_error=failure_score", "reward.remote.combine=add"])
    assert scores.tolist() == [1.0, -1.0]  # failure_score 0 added to the rule scores


def test_a_server_too_slow_times_out_instead_of_hanging(tokenizer):
    process, url = start_server("--scorer", f"{SCORERS}:stalls")
    slow = ["reward.remote.enable=true", f"reward.remote.url={url}", "reward.remote.timeout_s=0.5",
            "reward.remote.max_retries=1", "reward.remote.backoff_s=0.01"]
    try:
        started = time.monotonic()
        with pytest.raises(RemoteRewardError, match=f"{url}/score failed 2 attempts.*timed out"):
            grade(tokenizer, slow)
        scores, _, metrics = grade(tokenizer, [*slow, "reward.remote.on_error=failure_score"])
        assert time.monotonic() - started < 20  # two scoring calls of ~2 x 0.5 s each, plus the grading pools
    finally:
        stop_server(process)
    assert torch.equal(scores, torch.zeros(2)) and metrics["reward/remote/failed"] == 2


def test_remote_settings_are_checked_when_the_config_loads():
    with pytest.raises(ValueError, match="reward.remote.url='' must start with http"):
        build_config({}, ["reward.remote.enable=true"])
    with pytest.raises(ValueError, match="reward.remote.on_error='ignore' is not supported"):
        build_config({}, ["reward.remote.on_error=ignore"])
    assert not build_config({}, []).reward.remote.enable
