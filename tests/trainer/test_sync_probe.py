"""The trainer's side of the sync check without engines: the probe prompts it builds, the settings it refuses, and
rank 0's warning when the step's engine-vs-trainer mismatch jumps after a push (`MismatchWatch`; the checks after real
pushes are in the end-to-end tests: test_e2e.py, test_e2e_parallel.py, test_colocate.py,
tests/rollout/test_server_mode.py)."""
import logging

import pytest

from megatron_cpo.rollout.config import SyncCheckConfig
from megatron_cpo.trainer.driver.mismatch_watch import MismatchWatch
from megatron_cpo.trainer.workers.sync_probe import SyncProbe


@pytest.fixture
def make_probe(make_config, tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    def make(*overrides: str) -> SyncProbe:
        config = make_config(*overrides)
        engines_tokens = config.data.max_prompt_length + config.data.max_response_length  # the engines' max_model_len
        return SyncProbe(config.actor_rollout_ref.rollout.sync_check,
                         config.actor_rollout_ref.actor.megatron.params_dtype, engines_tokens, tokenizer,
                         tokenizer.pad_token_id)
    return make, tokenizer


def test_probe_prompts_are_the_chat_templated_texts_and_must_fit_the_engines(make_probe):
    make, tokenizer = make_probe
    probe = make("actor_rollout_ref.rollout.sync_check.prompts=[Compute 1 + 2.,Say hi.]")
    texts = ["<|im_start|>user\nCompute 1 + 2.<|im_end|>\n<|im_start|>assistant\n",
             "<|im_start|>user\nSay hi.<|im_end|>\n<|im_start|>assistant\n"]
    assert [tokenizer.decode(ids) for ids in probe.prompts] == texts
    assert probe.tolerance == 1e-3 and make("actor_rollout_ref.rollout.sync_check.tolerance=0.05").tolerance == 0.05
    with pytest.raises(ValueError, match=r"the longest sync-check probe prompt has \d+ tokens; with actor_rollout_ref."
                                         r"rollout.sync_check.max_tokens=390 it exceeds the engines' 396 tokens"):
        make("actor_rollout_ref.rollout.sync_check.max_tokens=390")


def test_only_a_push_with_requests_in_flight_that_is_probed_holds_them_for_the_probe(make_probe):
    make = make_probe[0]
    every_second = make("actor_rollout_ref.rollout.sync_check.every_n_pushes=2")
    held = []
    for _ in range(4):
        held.append([every_second.holds_paused_requests(policy) for policy in ("none", "partial", "keep")])
        every_second.pushes += 1  # as after_push counts them
    assert held == [[False, True, True], [False, False, False]] * 2
    assert not make("actor_rollout_ref.rollout.sync_check.enable=false").holds_paused_requests("partial")


def test_a_mismatch_jump_after_a_push_is_warned_about_once(caplog):
    watch = MismatchWatch(SyncCheckConfig(), "float32")

    def observe(step, mean, peak):
        watch.observe(step, {"mismatch/log_probs_diff_mean": mean, "mismatch/log_probs_diff_max": peak})

    with caplog.at_level(logging.WARNING, logger="megatron_cpo.trainer.driver.mismatch_watch"):
        observe(1, 1e-7, 7e-7)
        observe(2, 5e-6, 9e-5)  # 50x, but below the tolerance: no warning
        observe(3, 0.2, 0.99)
        observe(4, 5.0, 7.5)  # jumps again: already said
    (record,) = caplog.records
    assert record.getMessage().startswith(
        "mismatch/log_probs_diff_mean jumped from 5e-06 at step 2 to 0.2 at step 3 (max 0.99, above the float32 "
        "sync-check tolerance 0.001): step 3 sampled right after the weight push of step 2, so the engines most "
        "likely do not serve the pushed weights (a layer their reload did not update, e.g. a tied output head")


def test_with_stale_tokens_only_those_of_the_trained_weights_are_watched(caplog):
    """Asynchronous training: tokens sampled by older weights differ by the policy's change since, which is no sign
    of a bad push; a jump of the staleness-0 tokens' mismatch still is."""
    watch = MismatchWatch(SyncCheckConfig(), "float32")

    def observe(step, whole, fresh):
        metrics = {"mismatch/log_probs_diff_mean": whole[0], "mismatch/log_probs_diff_max": whole[1]}
        if fresh is not None:
            metrics.update({"mismatch/staleness_0/log_probs_diff_mean": fresh[0],
                            "mismatch/staleness_0/log_probs_diff_max": fresh[1]})
        metrics["mismatch/staleness_1/log_probs_diff_mean"] = whole[0]
        watch.observe(step, metrics)

    with caplog.at_level(logging.WARNING, logger="megatron_cpo.trainer.driver.mismatch_watch"):
        observe(1, (1e-7, 7e-7), (1e-7, 7e-7))
        observe(2, (0.05, 0.9), (1e-7, 8e-7))  # stale tokens differ a lot: no warning
        observe(3, (0.05, 0.9), None)          # no staleness-0 token: not observed
        assert not caplog.records
        observe(4, (0.2, 0.99), (0.2, 0.99))
    (record,) = caplog.records
    assert "jumped from 1e-07 at step 2 to 0.2 at step 4" in record.getMessage()
