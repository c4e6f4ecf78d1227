"""The tiny-model tool's supervised warm start, on a couple of steps only (the shipped model is not retrained)."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from megatron_cpo.data.synthetic import ArithConfig, generate_arith

TOOL = Path(__file__).resolve().parents[2] / "tools" / "make_tiny_model.py"


@pytest.fixture(scope="module")
def tool():
    spec = importlib.util.spec_from_file_location("make_tiny_model", TOOL)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_tiny_model"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def rows():
    return generate_arith(ArithConfig(num_train=16, num_test=5, seed=1))


def _fresh_model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def test_supervised_batch_trains_only_on_solution_and_end_of_turn(tool, tokenizer, rows):
    ids, mask, labels = tool.supervised_batch(tokenizer, rows["train"][:3])
    for i, row in enumerate(rows["train"][:3]):
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=False)
        target = labels[i][labels[i] != -100].tolist()
        assert tokenizer.decode(target) == row["extra_info"]["solution"] + "<|im_end|>"
        prompt_and_target = ids[i][mask[i].bool()].tolist()
        assert tokenizer.decode(prompt_and_target) == prompt + row["extra_info"]["solution"] + "<|im_end|>"


@pytest.mark.slow
def test_warm_start_is_deterministic_and_a_prefix_of_a_longer_run(tool, tokenizer, rows, tiny_model_dir):
    config = tool.WarmStartConfig(steps=2, batch_size=4, warmup_steps=1, log_every=0)
    first, second, longer = (_fresh_model(tiny_model_dir) for _ in range(3))
    initial = [p.detach().clone() for p in first.parameters()]
    losses = tool.warm_start(first, tokenizer, rows["train"], config)
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert tool.warm_start(second, tokenizer, rows["train"], config) == losses
    snapshots = {}
    tool.warm_start(longer, tokenizer, rows["train"], tool.WarmStartConfig(steps=3, batch_size=4, warmup_steps=1,
                                                                          log_every=0),
                    on_step=lambda step: snapshots.setdefault(step, [p.detach().clone() for p in longer.parameters()]))
    for a, b, c in zip(first.parameters(), second.parameters(), snapshots[2]):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert any(not torch.equal(a, start) for a, start in zip(first.parameters(), initial))


def test_evaluate_reports_per_level_accuracy_and_keeps_the_callers_rng(tool, tokenizer, rows, tiny_model_dir):
    model = _fresh_model(tiny_model_dir)
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    accuracy = tool.evaluate(model, tokenizer, rows["test"], do_sample=True, max_new_tokens=4)
    assert torch.equal(torch.rand(1), expected_next)
    levels = {f"level_{n}" for n in range(1, 6)}
    assert {"all", *levels, *(f"{level}/direct_share" for level in levels)} <= set(accuracy)
    assert all(0.0 <= value <= 1.0 for value in accuracy.values())


def test_warm_start_rows_mix_direct_answers_into_the_chosen_levels_only(tool):
    rows = generate_arith(ArithConfig(num_train=400, num_test=10, seed=0))["train"]
    config = tool.WarmStartConfig(levels=(1, 2), direct_answer_levels=(2,), direct_answer_fraction=0.7)
    chosen = tool.warm_start_rows(rows, config)
    assert chosen == tool.warm_start_rows(rows, config)
    assert [r["extra_info"]["index"] for r in chosen] == [r["extra_info"]["index"] for r in rows
                                                         if r["extra_info"]["level"] in (1, 2)]
    direct = [r["extra_info"]["solution"] == f"\\boxed{{{r['reward_model']['ground_truth']}}}" for r in chosen]
    level_two = [d for d, r in zip(direct, chosen) if r["extra_info"]["level"] == 2]
    assert not any(d for d, r in zip(direct, chosen) if r["extra_info"]["level"] == 1)
    assert 0.55 < sum(level_two) / len(level_two) < 0.85
    assert all("\n" in r["extra_info"]["solution"] for r in rows if r["extra_info"]["level"] == 2)
    with pytest.raises(ValueError, match="direct_answer_levels"):
        tool.WarmStartConfig(levels=(1,), direct_answer_levels=(2,))


def test_answer_checking(tool):
    assert tool.last_boxed("1+2=3\n\\boxed{2}\n\\boxed{ 3 }") == "3"
    assert tool.is_correct("so \\boxed{14}", "14") and tool.is_correct("\\boxed{14.0}", "14")
    assert not tool.is_correct("\\boxed{15}", "14") and not tool.is_correct("14", "14")
    assert not tool.is_correct("\\boxed{x}", "14")


def test_shipped_model_is_warm_started(tool):
    """The committed model loads with its tokenizer and solves held-out level-1 questions it never trained on."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shipped = TOOL.parents[1] / "examples" / "tiny" / "model"
    tokenizer = AutoTokenizer.from_pretrained(shipped)
    model = AutoModelForCausalLM.from_pretrained(shipped, dtype=torch.float32)
    assert model.config.head_dim >= 32 and model.config.model_type == "qwen2"
    test = [r for r in generate_arith(ArithConfig(num_train=0, num_test=200, seed=0))["test"]
            if r["extra_info"]["level"] == 1]
    accuracy = tool.evaluate(model, tokenizer, test, do_sample=False, max_new_tokens=24)
    assert accuracy["level_1"] >= 0.4
