"""The template-difference rule of templates.py: observation ids are what the chat template adds to the conversation
so far, starting with the separator the template writes after the end-of-turn token the engine stopped on; the
accumulated ids then begin the template's ids of the whole conversation. Checked on the tiny model's template, a
Qwen-style one (default system prompt, tools, grouped tool responses), a Llama-3-style one (no separator) and one
that rewrites earlier turns."""
import pytest

from megatron_cpo.envs.templates import ChatTemplate
from megatron_cpo.envs.tools import CalculatorTool
from tests.envs.templates import LLAMA3_STYLE, QWEN_STYLE, REASONING_DROPPING, tokenizer_with


def sampled(tokenizer, text: str, stop: str) -> list[int]:
    """What an engine returns for a turn: the text's ids, then the stop token it stopped on."""
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.convert_tokens_to_ids(stop)]


def run_conversation(template: ChatTemplate, stop: str, turns: list[tuple[str, list[dict]]], tools=None):
    """Accumulate ids token in / token out over `turns` of (sampled text, observation messages); return the ids, the
    conversation and each turn's prompt."""
    messages = [{"role": "user", "content": "Compute 2+3."}]
    ids = template.prompt_ids(messages, tools)
    prompts = []
    for text, observation in turns:
        prompts.append(list(ids))
        turn = sampled(template.tokenizer, text, stop)
        ids += turn
        messages.append({"role": "assistant", "content": template.decode(turn)})
        if observation:
            ids += template.observation(messages, observation, tools, stop).ids
            messages += observation
    return ids, messages, prompts


def test_tiny_template_observation_starts_with_the_newline_after_im_end():
    template = ChatTemplate(tokenizer_with())
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "5"}]
    observation = template.observation(messages, [{"role": "user", "content": "Wrong."}], None, "<|im_end|>")
    assert observation.text == "\n<|im_start|>user\nWrong.<|im_end|>\n<|im_start|>assistant\n"
    assert not observation.history_rewritten
    ids, conversation, prompts = run_conversation(template, "<|im_end|>", [
        ("\\boxed{6}", [{"role": "user", "content": "Wrong. Try again."}]), ("\\boxed{5}", [])])
    whole = template.encode(template.render(conversation, None, add_generation_prompt=False))
    assert whole[:len(ids)] == ids and template.decode(whole[len(ids):], False) == "\n"  # only the last "\n" left
    assert prompts[1][:len(prompts[0])] == prompts[0]  # each turn's prompt extends the previous one
    assert template.check_conversation(ids, conversation, None) == "same"


def test_qwen_style_tool_turns_with_a_default_system_prompt_and_grouped_tool_responses():
    template = ChatTemplate(tokenizer_with(QWEN_STYLE))
    tools = [CalculatorTool().schema]
    tool_outputs = [{"role": "tool", "content": "5"}, {"role": "tool", "content": "7"}]
    ids, conversation, prompts = run_conversation(template, "<|im_end|>", [
        ('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>', tool_outputs),
        ("\\boxed{5}", [])], tools)
    text = template.decode(ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n<tools>\n{")
    # the engine stopped at <|im_end|>; the observation supplied the "\n" after it, and both tool outputs went into
    # one user turn as the template groups them
    assert "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n" \
           "</tool_response><|im_end|>\n<|im_start|>assistant\n\\boxed{5}<|im_end|>" in text
    whole = template.encode(template.render(conversation, tools, add_generation_prompt=False))
    assert whole[:len(ids)] == ids and len(whole) == len(ids) + 1
    assert template.check_conversation(ids, conversation, tools) == "same"


def test_llama3_style_has_no_separator_after_the_end_of_turn_token():
    specials = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
    template = ChatTemplate(tokenizer_with(LLAMA3_STYLE, specials))
    observation = template.observation([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                       [{"role": "user", "content": "again"}], None, "<|eot_id|>")
    assert observation.text == "<|start_header_id|>user<|end_header_id|>\n\nagain<|eot_id|>" \
                               "<|start_header_id|>assistant<|end_header_id|>\n\n"
    ids, conversation, _ = run_conversation(template, "<|eot_id|>", [("a", [{"role": "user", "content": "b"}]),
                                                                      ("c", [])])
    assert template.encode(template.render(conversation, None, False)) == ids
    assert template.check_conversation(ids, conversation, None) == "same"


def test_a_template_that_rewrites_earlier_turns_falls_back_to_a_fixed_base_and_the_check_says_so():
    template = ChatTemplate(tokenizer_with(REASONING_DROPPING))
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hmm</think>4"}]
    observation = template.observation(history, [{"role": "user", "content": "Wrong."}], None, "<|im_end|>")
    assert observation.history_rewritten
    assert observation.text == "\n<|im_start|>user\nWrong.<|im_end|>\n<|im_start|>assistant\n"
    ids, conversation, _ = run_conversation(template, "<|im_end|>", [
        ("<think>hmm</think>4", [{"role": "user", "content": "Wrong."}]), ("5", [])])
    # the model saw its own reasoning (the ids it sampled); the template's view of the conversation drops it
    assert template.check_conversation(ids, conversation, None) == "differs"


def test_same_text_other_ids_is_a_retokenization_not_a_template_difference():
    tokenizer = tokenizer_with()
    template = ChatTemplate(tokenizer)
    spelled = tokenizer("x<|im_end|>", add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert len(spelled) == len("x<|im_end|>")  # the end-of-turn marker spelt out character by character
    ids = template.prompt_ids([{"role": "user", "content": "q"}], None) + spelled + [tokenizer.eos_token_id]
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": template.decode(ids[-12:])}]
    assert template.check_conversation(ids, conversation, None) == "retokenized"


@pytest.mark.parametrize("mode, expected", [(False, "differs"), (True, "same-or-retokenized")])
def test_whitespace_only_differences_pass_when_strippable_whitespace_is_ignored(mode, expected):
    template = ChatTemplate(tokenizer_with())
    ids = template.prompt_ids([{"role": "user", "content": "q"}], None)
    ids += sampled(template.tokenizer, "a ", "<|im_end|>")
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    result = template.check_conversation(ids, conversation, None, ignore_whitespace=mode)
    assert result == expected if expected == "differs" else result in ("same", "retokenized")
