"""What the self teacher of table (f) says, re-derived with `transformers` alone (no Megatron, no engine).

The policy (the tiny warm start, or any Hugging Face directory) samples `--samples` answers at temperature 1 for
each of `--prompts` training questions; each answer is then scored twice by the same model: after its plain prompt
(the student) and after its hint context (the self teacher: the prompt with the gold solution, built by
data/hints.py as the trainer builds it). Printed: the per-token D = log p_teacher - log p_student over the answers
(what k1 rewards), split into correct and wrong answers and into the answer's first tokens, and how often the hinted
model's greedy answer is right. The trainer logged D of 2.2-2.5 nats a token at OPSD's first step; this says
whether that is the model (same numbers here) and whether the signal prefers right answers at all.

    python benchmarks/learning/check_self_teacher.py --model examples/tiny/model
    python benchmarks/learning/check_self_teacher.py --model examples/smollm2-135m/model \
        --data outputs/addition/train.parquet --max-new-tokens 128
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from tasks import write_task  # noqa: E402

from megatron_cpo.data.config import DataConfig  # noqa: E402
from megatron_cpo.data.dataset import PromptDataset  # noqa: E402
from megatron_cpo.data.hints import HintReader, build_hint_contexts  # noqa: E402
from megatron_cpo.rewards.registry import compute_score  # noqa: E402


def token_log_probs(model, prompt: list[int], response: list[int]) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) for every response token, [len(response)]."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]


def main(argv: list[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="examples/tiny/model")
    parser.add_argument("--task", default="arith12", help="a learning-table task, written to a temporary directory")
    parser.add_argument("--data", help="a verl-schema train parquet instead of --task")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data or str(write_task(args.task, tmp)["train"])
        records = PromptDataset(data, tokenizer, DataConfig(max_prompt_length=384)).records
    records = records[:args.prompts]
    hints, _ = HintReader().read([r.extra_info for r in records], [r.reward_model for r in records])
    contexts = build_hint_contexts(tokenizer, [r.messages for r in records], hints, [r.prompt_ids for r in records],
                                   384)
    eos = tokenizer.eos_token_id
    d_right, d_wrong, d_first, greedy_plain, greedy_hinted = [], [], [], 0, 0
    for record, hinted, has_hint in zip(records, contexts.prompt_ids, contexts.has_hint.tolist()):
        if not has_hint:
            continue
        for prompt, counter in ((record.prompt_ids, "plain"), (hinted, "hinted")):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_new_tokens,
                                 do_sample=False, eos_token_id=eos, pad_token_id=eos)[0, len(prompt):].tolist()
            right = compute_score(record.data_source, tokenizer.decode(out, skip_special_tokens=True),
                                  record.ground_truth)["acc"]
            greedy_plain += right and counter == "plain"
            greedy_hinted += right and counter == "hinted"
        ids = torch.tensor([record.prompt_ids]).repeat(args.samples, 1)  # same prompt: no padding
        samples = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0, top_k=0,
                                 top_p=1.0, max_new_tokens=args.max_new_tokens, eos_token_id=eos,
                                 pad_token_id=eos)[:, len(record.prompt_ids):]
        for sample in samples.tolist():
            response = sample[:sample.index(eos) + 1] if eos in sample else sample
            d = token_log_probs(model, hinted, response) - token_log_probs(model, record.prompt_ids, response)
            right = compute_score(record.data_source, tokenizer.decode(response, skip_special_tokens=True),
                                  record.ground_truth)["acc"]
            (d_right if right else d_wrong).append(d)
            d_first.append(d[:4])
    hinted_rows = int(contexts.has_hint.sum())
    every = torch.cat(d_right + d_wrong)
    print(f"model {args.model}: {hinted_rows} questions with a hint x {args.samples} samples, temperature 1")
    print(f"greedy accuracy: plain prompt {greedy_plain}/{hinted_rows}, hint context {greedy_hinted}/{hinted_rows}")
    print(f"per-token D = log p(y|hint) - log p(y|prompt): mean {every.mean():+.3f}, mean |D| {every.abs().mean():.3f}"
          f" over {every.numel()} tokens")
    for name, rows in (("correct", d_right), ("wrong", d_wrong)):
        if rows:
            tokens = torch.cat(rows)
            per_answer = torch.stack([r.sum() for r in rows])
            print(f"  {name:7s} answers ({len(rows):4d}): per-token D mean {tokens.mean():+.3f}, per-answer sum D "
                  f"mean {per_answer.mean():+.2f}")
    print(f"  first 4 tokens of each answer: per-token D mean {torch.cat(d_first).mean():+.3f}")


if __name__ == "__main__":
    main()
