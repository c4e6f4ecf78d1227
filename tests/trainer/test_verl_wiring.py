"""The verl settings that mean something here reach the code that uses them (hand-derived expected values)."""
from pathlib import Path
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from megatron_cpo.config import build_config
from megatron_cpo.trainer.driver.controller import prompt_limit
from megatron_cpo.trainer.driver.verl_metrics import with_verl_names
from megatron_cpo.trainer.workers.policy_update import token_rewards_of

TINY_MODEL = Path(__file__).resolve().parents[2] / "examples" / "tiny" / "model"


def test_kl_in_reward_subtracts_the_kl_from_each_token_reward():
    # response 0: 2 tokens, k1 = log p - log p_ref = (-1 - -1.5, -2 - -1) = (0.5, -1), its score 1 on its last token;
    # response 1: 1 token, k1 = -0.3 - -0.1 = -0.2; the padded positions carry garbage that must not count.
    config = build_config({}, ["algorithm.use_kl_in_reward=true", "algorithm.kl_penalty=k1",
                               "algorithm.kl_ctrl.kl_coef=0.2"])
    lp = SimpleNamespace(old_log_probs=torch.tensor([[-1.0, -2.0, 5.0], [-0.3, 7.0, 7.0]]),
                         ref_log_probs=torch.tensor([[-1.5, -1.0, 0.0], [-0.1, 0.0, 0.0]]),
                         mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    rewards, metrics = token_rewards_of(SimpleNamespace(scores=torch.tensor([1.0, 0.0])), lp, config.algorithm)
    torch.testing.assert_close(rewards, torch.tensor([[-0.2 * 0.5, 1.0 + 0.2, 0.0], [0.2 * 0.2, 0.0, 0.0]]))
    assert rewards.sum(-1).tolist() == pytest.approx([1.0 - 0.2 * -0.5, 0.0 - 0.2 * -0.2])  # [1.1, 0.04]
    assert metrics["actor/reward_kl_penalty_coeff"] == pytest.approx(0.2)


def test_kl_in_reward_settings():
    config = build_config({}, ["algorithm.use_kl_in_reward=true", "algorithm.kl_ctrl.kl_coef=0.05",
                               "algorithm.kl_penalty=low_var_kl"])
    assert (config.algorithm.kl_ctrl.kl_coef, config.algorithm.kl_penalty) == (0.05, "low_var_kl")


def test_gen_batch_size_is_the_unit_of_max_num_gen_batches():
    base = ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "algorithm.filter_groups.max_num_gen_batches=3"]

    def limit(config):
        return prompt_limit(config.algorithm.filter_groups, config.actor_rollout_ref.rollout,
                            config.data.generation_batch_size)

    config = build_config({}, [*base, "data.gen_batch_size=12", "algorithm.filter_groups.enable=true"])
    assert (config.data.generation_batch_size, limit(config)) == (12, 36)
    assert limit(build_config({}, [*base, "algorithm.filter_groups.enable=true"])) == 12
    ragen = build_config({}, [*base, "actor_rollout_ref.rollout.rollout_filter_strategy=top_p",
                              "actor_rollout_ref.rollout.rollout_filter_value=0.5"])
    assert limit(ragen) == 12  # the limit bounds RAGEN's filter too
    assert limit(build_config({}, base)) is None  # without a filter nothing is dropped: no limit
    with pytest.raises(ValueError, match="data.gen_batch_size=2 is below data.train_batch_size=4"):
        build_config({}, ["data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                          "data.gen_batch_size=2"])


def test_val_kwargs_choose_the_validation_sampling():
    from megatron_cpo.trainer.driver.rollout_side import training_sampling_params
    from megatron_cpo.trainer.driver.validation import Validator

    def params(*overrides, index=5):
        config = build_config({}, list(overrides))
        rollout = config.actor_rollout_ref.rollout
        greedy = training_sampling_params(rollout, config.data.max_response_length, eos_token_id=2, seed=None,
                                          greedy=True)
        return Validator(None, None, None, greedy, rollout.val_kwargs, config.trainer.seed).params(index)

    greedy = params()
    assert (greedy.n, greedy.temperature, greedy.top_p, greedy.top_k) == (1, 0.0, 1.0, -1)
    sampled = params(
        "actor_rollout_ref.rollout.val_kwargs.do_sample=true", "actor_rollout_ref.rollout.val_kwargs.n=4",
        "actor_rollout_ref.rollout.val_kwargs.temperature=0.6", "actor_rollout_ref.rollout.val_kwargs.top_p=0.7",
        "data.max_response_length=20", "trainer.seed=3")
    assert (sampled.n, sampled.temperature, sampled.top_p, sampled.max_tokens, sampled.seed) == (4, 0.6, 0.7, 20, 8)


def test_data_keys_reach_the_dataset(tmp_path):
    from transformers import AutoTokenizer

    from megatron_cpo.data.dataset import PromptDataset

    def rows(texts):
        return [{"question": [{"role": "user", "content": t}], "data_source": "math",
                 "reward_model": {"ground_truth": "1"}} for t in texts]

    pq.write_table(pa.Table.from_pylist(rows(["short", "x " * 200])), tmp_path / "a.parquet")
    pq.write_table(pa.Table.from_pylist(rows(["also short"])), tmp_path / "b.parquet")
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    files = f"data.train_files=[{tmp_path / 'a.parquet'},{tmp_path / 'b.parquet'}]"
    config = build_config({}, [files, "data.prompt_key=question", "data.max_prompt_length=64",
                               "data.filter_overlong_prompts=true"])
    dataset = PromptDataset(config.data.train_files, tokenizer, config.data)
    assert (len(dataset), dataset.num_filtered) == (2, 1)  # the long prompt of a.parquet is dropped
    config = build_config({}, [files, "data.prompt_key=question", "data.max_prompt_length=64",
                               "data.truncation=left"])
    dataset = PromptDataset(config.data.train_files, tokenizer, config.data)
    assert len(dataset) == 3 and max(len(r.prompt_ids) for r in dataset.records) == 64


def test_verl_metric_names_are_added_beside_ours():
    ours = {"reward/mean": 0.5, "reward/max": 1.0, "completions/mean_length": 12.0, "pg_loss": 0.1,
            "entropy/mean": 2.0, "val/acc": 0.25, "val/math/acc": 0.5, "val/math/score": 0.0, "kl": 0.3}
    logged = with_verl_names(ours, step=7, val_samples=4)
    assert {k: v for k, v in logged.items() if k in ours} == ours  # our names stay
    assert logged["critic/score/mean"] == logged["critic/rewards/mean"] == 0.5
    assert logged["critic/score/max"] == 1.0 and logged["response_length/mean"] == 12.0
    assert (logged["actor/pg_loss"], logged["actor/entropy"], logged["training/global_step"]) == (0.1, 2.0, 7.0)
    assert logged["val-core/math/acc/mean@4"] == 0.5 and logged["val-core/math/reward/mean@4"] == 0.0
    assert "actor/ppo_kl" not in logged  # our kl (actor vs reference) is not verl's ppo_kl
    with_kl = with_verl_names({"reward/mean": 0.5, "reward/with_kl_mean": 0.4}, step=1)
    assert with_kl["critic/rewards/mean"] == 0.4 and with_kl["critic/score/mean"] == 0.5


def test_metric_logger_writes_verl_names_to_files_not_the_console(tmp_path, capsys):
    import json

    from megatron_cpo.trainer.driver.loggers import MetricLogger

    metric_logger = MetricLogger(["console", "jsonl"], tmp_path, 10, "p", "n", {}, verl_names=True)
    metric_logger.log({"reward/mean": 0.5}, 1)
    metric_logger.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/mean"] == row["critic/score/mean"] == 0.5
    assert "critic/score/mean" not in capsys.readouterr().out
    (tmp_path / "plain").mkdir()
    plain = MetricLogger(["jsonl"], tmp_path / "plain", 10, "p", "n", {}, verl_names=False)
    plain.log({"reward/mean": 0.5}, 1)
    plain.close()
    assert "critic/score/mean" not in (tmp_path / "plain" / "metrics.jsonl").read_text()


def test_val_max_samples_caps_the_validation_set():
    from megatron_cpo.trainer.driver.validation import Validator

    def size(*overrides):
        config = build_config({}, list(overrides))
        return Validator(list(range(10)), None, None, None, config.actor_rollout_ref.rollout.val_kwargs,
                         max_samples=config.data.val_max_samples).size()

    assert (size(), size("data.val_max_samples=3"), size("data.val_max_samples=50")) == (10, 3, 10)
    with pytest.raises(ValueError, match="data.val_max_samples=0 must be >= 1, or -1"):
        build_config({}, ["data.val_max_samples=0"])


def _hint_builder(*overrides):
    from transformers import AutoTokenizer

    from megatron_cpo.trainer.driver.rollout_side import HintContextBuilder

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL)
    config = build_config({}, ["algorithm.adv_estimator=cpo", "data.max_prompt_length=512", *overrides])
    algorithm = config.algorithm
    return HintContextBuilder(algorithm.cpo, config.data, tokenizer, algorithm.shaper.hinted_responses), tokenizer


def _addition_group(tokenizer, a, b, acc):
    from megatron_cpo.data.dataset import PromptRecord

    messages = [{"role": "user", "content": f"What is {a} + {b}?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    record = PromptRecord(f"u{a}", 0, messages, prompt, "megatron_cpo/addition", str(a + b),
                          extra_info={"solution": f"So {a} + {b} = {a + b}."})
    return SimpleNamespace(record=record, n=len(acc), acc=torch.tensor(acc), prompt_token_ids=prompt)


def test_hint_instruction_reaches_the_hint_context():
    """`data.hint_instruction` is the second user turn's instruction of CPO's hinted prompt (the SmolLM2 example asks
    for the sum last instead of a boxed answer)."""
    builder, tokenizer = _hint_builder("data.hint_instruction=End with the sum.", "algorithm.cpo.wrap_method=mi3")
    hints = builder([_addition_group(tokenizer, 47, 38, [0.0])])
    text = tokenizer.decode(hints["hint_prompt_ids"][0])
    assert "So 47 + 38 = 85." in text and "What is 47 + 38?\nEnd with the sum." in text and "boxed" not in text


def test_hinted_prompts_are_built_only_for_the_responses_the_rule_can_change():
    """The shaper names the responses a hint can change (`hinted_responses`); only they get a hinted prompt, and a
    batch where none qualifies (`negonly_mi3` on filter-groups' mixed prompts) builds none."""
    builder, tokenizer = _hint_builder("algorithm.cpo.wrap_method=negonly_mi3")
    mixed, all_wrong = _addition_group(tokenizer, 47, 38, [1.0, 0.0]), _addition_group(tokenizer, 12, 19, [0.0, 0.0])
    hints = builder([mixed, all_wrong])
    assert hints["has_hint"].tolist() == [False, False, True, True] and len(hints["hint_prompt_ids"]) == 2
    assert "So 12 + 19 = 31." in tokenizer.decode(hints["hint_prompt_ids"][0])
    assert hints["hint_metrics"]["cpo/hint_source/extra_info.solution"] == 2
    assert set(builder([mixed, mixed])) == {"has_hint"} and not builder([mixed, mixed])["has_hint"].any()
    mi3, _ = _hint_builder("algorithm.cpo.wrap_method=mi3")  # every wrong response
    assert mi3([mixed, all_wrong])["has_hint"].tolist() == [False, True, True, True]
    no_gold, _ = _hint_builder("algorithm.cpo.wrap_method=mi3", "algorithm.cpo.gold_as_hint=false")
    assert not no_gold([mixed, all_wrong])["has_hint"].any()
