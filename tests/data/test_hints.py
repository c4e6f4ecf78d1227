"""CPO hint contexts through the real tiny tokenizer's chat template: contents, truncation, unchanged responses,
the gold-hint fallback chain (data.hint_key) on verl-built GSM8K and MATH rows."""
import pytest

from megatron_cpo.data.dataset import PromptDataset
from megatron_cpo.data.hints import DEFAULT_INSTRUCTION, HintReader, HintTemplate, build_hint_contexts, find_hint

LENGTH = 1024  # tokens a hinted prompt may take unless a test says otherwise


@pytest.fixture(scope="module")
def records(arith_files, tokenizer):
    dataset = PromptDataset(arith_files["test"], tokenizer)
    return dataset.records[:6]


def _build(tokenizer, records, max_prompt_length=LENGTH, template=None, hints=None):
    hints = [r.extra_info["solution"] for r in records] if hints is None else hints
    return build_hint_contexts(tokenizer, [r.messages for r in records], hints, [r.prompt_ids for r in records],
                               max_prompt_length, template)


def test_hint_context_reads_as_the_spec_says(tokenizer, records):
    contexts = _build(tokenizer, records)
    record = records[1]
    question = record.messages[1]["content"]
    expected = (
        "<|im_start|>system\nYou are a calculator.<|im_end|>\n"
        f"<|im_start|>user\n{question}<|im_end|>\n"
        f"<|im_start|>assistant\n{record.extra_info['solution']}<|im_end|>\n"
        f"<|im_start|>user\n{question}\n{DEFAULT_INSTRUCTION}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert tokenizer.decode(contexts.prompt_ids[1]) == expected
    assert contexts.has_hint.tolist() == [True] * 6 and contexts.num_truncated == 0
    assert DEFAULT_INSTRUCTION == ("Please refer to the above solution to derive your answer, reason step by step, "
                                   "and put your final answer within \\boxed{}.")


def test_hint_and_instruction_are_configurable(tokenizer, records):
    template = HintTemplate(hint_template="Reference: {solution}", second_turn_template="{instruction} {question}",
                            instruction="Use it.")
    text = tokenizer.decode(_build(tokenizer, records, template=template).prompt_ids[0])
    assert f"<|im_start|>assistant\nReference: {records[0].extra_info['solution']}<|im_end|>" in text
    assert f"<|im_start|>user\nUse it. {records[0].messages[1]['content']}<|im_end|>" in text
    with pytest.raises(ValueError, match="must contain '{solution}'"):
        HintTemplate(hint_template="no slot")


def test_long_hints_are_cut_from_the_left_to_fit(tokenizer, records):
    full = _build(tokenizer, records)
    lengths = [len(ids) for ids in full.prompt_ids]
    limit = sorted(lengths)[2]
    cut = _build(tokenizer, records, limit)
    assert max(len(ids) for ids in cut.prompt_ids) == limit
    expected_cut = [max(0, n - limit) for n in lengths]
    assert cut.truncated_tokens.tolist() == expected_cut
    assert cut.num_truncated == sum(n > 0 for n in expected_cut) >= 1
    longest = lengths.index(max(lengths))
    solution = records[longest].extra_info["solution"]
    text = tokenizer.decode(cut.prompt_ids[longest])
    kept = solution[expected_cut[longest]:]
    assert f"<|im_start|>assistant\n{kept}<|im_end|>" in text and kept.endswith("}")
    with pytest.raises(ValueError, match="without any hint, more than data.max_prompt_length=50"):
        _build(tokenizer, records, 50)


def test_gold_hint_fallback_chain():
    assert find_hint({"solution": "s", "gold_solution": "g"}, {"ground_truth": "7"})[0] == "s"
    assert find_hint({"solution": "", "gold_solution": "g"}, {"ground_truth": "7"})[0] == "g"
    assert find_hint({"level": 1}, {"ground_truth": 7})[0] == "7"
    assert find_hint(None, {"style": "rule"})[0] is None
    assert find_hint({}, None)[0] is None


def test_rows_without_hint_keep_their_prompt_and_are_flagged(tokenizer, records):
    hints = [None, records[1].extra_info["solution"], None, "42", None, None]
    contexts = _build(tokenizer, records, hints=hints)
    assert contexts.has_hint.tolist() == [False, True, False, True, False, False]
    assert contexts.prompt_ids[0] == records[0].prompt_ids
    assert "<|im_start|>assistant\n42<|im_end|>" in tokenizer.decode(contexts.prompt_ids[3])


# Rows built the way verl's examples/data_preprocess scripts build them (gsm8k.py, math_dataset.py), and ours.
GSM8K_ANSWER = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                "altogether in April and May.\n#### 72")
VERL_GSM8K_ROW = {"reward_model": {"style": "rule", "ground_truth": "72"},
                  "extra_info": {"split": "train", "index": 0, "answer": GSM8K_ANSWER,
                                 "question": "Natalia sold clips to 48 of her friends in April, ..."}}
VERL_MATH_ROW = {"reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
                 "extra_info": {"split": "test", "index": 3}}
PREPARED_MATH_ROW = {"reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
                     "extra_info": {"split": "test", "index": 3, "answer": "\\frac{1}{2}",
                                    "solution": "Half of it: $\\boxed{\\frac{1}{2}}$."}}


def test_gsm8k_hint_is_the_worked_answer_not_the_bare_number():
    hint, key = find_hint(VERL_GSM8K_ROW["extra_info"], VERL_GSM8K_ROW["reward_model"])
    assert (hint, key) == (GSM8K_ANSWER, "extra_info.answer")


def test_math_hints_prefer_the_solution_and_fall_back_to_the_answer():
    assert find_hint(PREPARED_MATH_ROW["extra_info"], PREPARED_MATH_ROW["reward_model"]) == (
        "Half of it: $\\boxed{\\frac{1}{2}}$.", "extra_info.solution")
    assert find_hint(VERL_MATH_ROW["extra_info"], VERL_MATH_ROW["reward_model"]) == (
        "\\frac{1}{2}", "reward_model.ground_truth")


def test_hint_keys_are_an_ordered_configurable_list():
    nested = {"meta": {"worked": "step 1, step 2"}, "solution": " "}
    assert find_hint(nested, {}, ["extra_info.solution", "extra_info.meta.worked"]) == (
        "step 1, step 2", "extra_info.meta.worked")
    assert find_hint(VERL_MATH_ROW["extra_info"], VERL_MATH_ROW["reward_model"], ["extra_info.solution"]) == (
        None, None)
    with pytest.raises(ValueError, match="must be a dotted path starting at extra_info or reward_model"):
        HintReader(["solution"])


def test_hint_reader_counts_sources_and_warns_once_about_bare_answers(caplog):
    reader = HintReader()
    rows = [VERL_GSM8K_ROW, VERL_MATH_ROW, PREPARED_MATH_ROW, VERL_MATH_ROW, {"extra_info": {}, "reward_model": {}}]
    with caplog.at_level("WARNING", logger="megatron_cpo.data.hints"):
        hints, metrics = reader.read([r["extra_info"] for r in rows], [r["reward_model"] for r in rows])
        reader.read([VERL_MATH_ROW["extra_info"]], [VERL_MATH_ROW["reward_model"]])
    assert hints == [GSM8K_ANSWER, "\\frac{1}{2}", "Half of it: $\\boxed{\\frac{1}{2}}$.", "\\frac{1}{2}", None]
    assert metrics == {"cpo/hint_source/extra_info.answer": 1.0, "cpo/hint_source/extra_info.solution": 1.0,
                       "cpo/hint_source/reward_model.ground_truth": 2.0, "cpo/hint_source/none": 1.0,
                       "cpo/hint_bare_answer": 2.0}
    warnings = [r.getMessage() for r in caplog.records if "bare answer" in r.getMessage()]
    assert len(warnings) == 1 and "2 of 5 CPO hints" in warnings[0] and "reward_model.ground_truth" in warnings[0]


def test_an_answer_field_holding_the_bare_answer_is_flagged_too():
    _, metrics = HintReader().read([{"answer": "72"}], [{"ground_truth": "72"}])
    assert metrics["cpo/hint_source/extra_info.answer"] == 1.0 and metrics["cpo/hint_bare_answer"] == 1.0
