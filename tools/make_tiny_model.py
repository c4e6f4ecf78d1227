"""Write the tiny Qwen2 model the quickstart trains, optionally warm-started on the synthetic arithmetic task.

A randomly initialised model never produces `\\boxed{...}`, so RL would see only zero-variance groups. `--warm-start`
runs a short supervised pass (plain torch + transformers on CPU) over the quickstart levels of the synthetic train
split, in the chat format the trainer uses (chat template with the generation prompt, then solution + end-of-turn
token). It then reports per-level held-out accuracy under greedy and temperature-1 sampling with `transformers`
`generate`.

What RL can learn from it: on level 2 (a+b+c) most warm-up targets are the bare answer `\\boxed{t}` and the rest are
the worked steps (`a+b=s`, `s+c=t`, then the box). The model therefore answers directly by default, which is
usually wrong (one forward pass cannot add three digits reliably at this size), and works the steps in a minority of
samples, which are right far more often. Choosing the worked steps is a behaviour, not a memorised fact, so it carries
over to held-out questions: that is the headroom the quickstart's GRPO / DAPO / CPO runs show. The gold solution the
CPO hint shows is always the worked one.

    python tools/make_tiny_model.py --out examples/tiny/model --warm-start
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_cpo.data.synthetic import ArithConfig, generate_arith  # noqa: E402
from megatron_cpo.models.tiny import write_tiny_model  # noqa: E402
from megatron_cpo.rewards.math_answer import last_boxed as parse_last_boxed  # noqa: E402

# The shipped model keeps write_tiny_model's default size (hidden 128, 2 layers, 4 heads x 32): RL steps on 2 CPU
# cores stay fast. Config overrides for a larger model go here.
QUICKSTART_OVERRIDES: dict = {}


@dataclass
class WarmStartConfig:
    """Supervised warm-up on gold solutions: steps, batch, AdamW learning rate with a linear warm-up, then constant.

    The rate stays constant after warm-up so that the model after k steps of a longer run is exactly the model of a
    k-step run: one run with `eval_every` shows which step count gives the accuracy band RL needs.
    """

    steps: int = 2500
    batch_size: int = 16
    learning_rate: float = 4e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    num_train: int = 4000
    seed: int = 0
    log_every: int = 50
    levels: tuple[int, ...] = (1, 2)
    direct_answer_levels: tuple[int, ...] = (2,)
    direct_answer_fraction: float = 0.7

    def __post_init__(self) -> None:
        if not 0.0 <= self.direct_answer_fraction <= 1.0:
            raise ValueError(f"direct_answer_fraction={self.direct_answer_fraction} must be in [0, 1]")
        if not set(self.direct_answer_levels) <= set(self.levels):
            raise ValueError(f"direct_answer_levels={self.direct_answer_levels} must be a subset of "
                             f"levels={self.levels} (the levels the warm-up trains on)")


def direct_answer(row: dict) -> str:
    """The bare boxed answer of a row, without the worked steps."""
    return f"\\boxed{{{row['reward_model']['ground_truth']}}}"


def warm_start_rows(rows: list[dict], config: WarmStartConfig) -> list[dict]:
    """The rows the warm-up trains on: those of `config.levels`, in order, where a seeded `direct_answer_fraction`
    of the `direct_answer_levels` rows target the bare answer instead of the worked steps (copies; `rows` is kept).

    The draw uses `random.Random(seed + 1)`, a stream apart from the one that orders the batches.
    """
    draw = random.Random(config.seed + 1)
    chosen = []
    for row in rows:
        level = row["extra_info"]["level"]
        if level not in config.levels:
            continue
        if level in config.direct_answer_levels and draw.random() < config.direct_answer_fraction:
            row = {**row, "extra_info": {**row["extra_info"], "solution": direct_answer(row)}}
        chosen.append(row)
    return chosen


def last_boxed(text: str) -> str | None:
    """The stripped content of the last `\\boxed{...}` in `text` (the graders' parser), or None."""
    found = parse_last_boxed(text)
    return found.strip() if found is not None else None


def is_correct(response: str, ground_truth: str) -> bool:
    """The last boxed answer equals the ground truth as a number."""
    answer = last_boxed(response)
    try:
        return answer is not None and float(answer) == float(ground_truth)
    except ValueError:
        return False


def prompt_ids(tokenizer, row: dict) -> list[int]:
    """Token ids of a row's chat prompt with the assistant generation prompt (what the rollout engine receives)."""
    return tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True,
                                         return_dict=False)


def supervised_batch(tokenizer, rows: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 outside the solution + end-of-turn tokens)."""
    sequences, labels = [], []
    for row in rows:
        prompt = prompt_ids(tokenizer, row)
        response = tokenizer.encode(row["extra_info"]["solution"], add_special_tokens=False) + [tokenizer.eos_token_id]
        sequences.append(prompt + response)
        labels.append([-100] * len(prompt) + response)
    width = max(len(s) for s in sequences)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    target = torch.full((len(rows), width), -100, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (seq, lab) in enumerate(zip(sequences, labels)):
        ids[i, : len(seq)] = torch.tensor(seq)
        target[i, : len(lab)] = torch.tensor(lab)
        mask[i, : len(seq)] = 1
    return ids, mask, target


def warm_start(model, tokenizer, rows: list[dict], config: WarmStartConfig,
               on_step: Callable[[int], None] | None = None) -> list[float]:
    """Train `model` in place on the gold solutions of `rows`; returns the loss of every step.

    `on_step(step)` runs after every optimizer step (1-based), e.g. to evaluate or snapshot the model.
    """
    torch.manual_seed(config.seed)
    order = random.Random(config.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.learning_rate, weight_decay=config.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / config.warmup_steps))
    model.train()
    losses, pool = [], []
    for step in range(config.steps):
        if len(pool) < config.batch_size:
            pool.extend(order.sample(rows, len(rows)))
        batch, pool = pool[: config.batch_size], pool[config.batch_size :]
        ids, mask, labels = supervised_batch(tokenizer, batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1)
        if config.log_every and (step + 1) % config.log_every == 0:
            print(f"step {step + 1}/{config.steps} loss {sum(losses[-config.log_every:]) / config.log_every:.4f}",
                  flush=True)
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model, tokenizer, rows: list[dict], do_sample: bool, max_new_tokens: int = 48, batch_size: int = 100,
             seed: int = 0) -> dict[str, float]:
    """Held-out accuracy per level and overall ("all") from `generate` (greedy, or temperature-1 sampling), and per
    level the share of answers given directly (`level_N/direct_share`: the response opens with `\\boxed`) and the
    accuracy of direct and worked answers (`level_N/direct_accuracy`, `level_N/worked_accuracy`, when there are any).

    Sampling is seeded by `seed` without disturbing the caller's random state (a mid-training evaluation leaves the
    training run unchanged).
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _evaluate(model, tokenizer, rows, do_sample, max_new_tokens, batch_size)


def _evaluate(model, tokenizer, rows: list[dict], do_sample: bool, max_new_tokens: int,
              batch_size: int) -> dict[str, float]:
    was_training = model.training
    model.eval()
    correct: dict[str, list[bool]] = defaultdict(list)
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        prompts = [prompt_ids(tokenizer, row) for row in chunk]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0) if do_sample else dict(do_sample=False)
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, **sampling)
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
        for row, text in zip(chunk, texts):
            ok = is_correct(text, row["reward_model"]["ground_truth"])
            level = f"level_{row['extra_info']['level']}"
            direct = text.lstrip().startswith("\\boxed")
            correct[level].append(ok)
            correct["all"].append(ok)
            correct[f"{level}/direct_share"].append(direct)
            correct[f"{level}/{'direct' if direct else 'worked'}_accuracy"].append(ok)
    model.train(was_training)
    return {name: sum(v) / len(v) for name, v in sorted(correct.items())}


def make_tiny_model(out: Path, seed: int, warm: WarmStartConfig | None, num_test: int, eval_every: int = 0,
                    snapshot_dir: Path | None = None, overrides: dict | None = None) -> dict:
    """Write the model (warm-started when `warm` is given) and return the measured accuracies and timing.

    With `eval_every`, held-out accuracy is also measured every that many steps (the report's `trajectory`) and,
    with `snapshot_dir`, the model is saved there at each of those steps.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    overrides = QUICKSTART_OVERRIDES if overrides is None else overrides
    write_tiny_model(out, family="qwen2", seed=seed, **overrides)
    report: dict = {"seed": seed, "overrides": overrides}
    if warm is None:
        return report
    torch.set_num_threads(1)  # one thread: the same float reduction order, so the same weights, on any core count
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    splits = generate_arith(ArithConfig(num_train=warm.num_train, num_test=num_test, seed=seed))
    splits = {"train": warm_start_rows(splits["train"], warm),
              "test": [row for row in splits["test"] if row["extra_info"]["level"] in warm.levels]}
    trajectory: list[dict] = []

    def checkpoint(step: int) -> None:
        if not eval_every or step % eval_every:
            return
        trajectory.append({"step": step, "seconds": round(time.time() - started, 1),
                           "greedy": evaluate(model, tokenizer, splits["test"], do_sample=False, seed=seed),
                           "sampled": evaluate(model, tokenizer, splits["test"], do_sample=True, seed=seed)})
        print(json.dumps(trajectory[-1]), flush=True)
        if snapshot_dir is not None:
            model.save_pretrained(Path(snapshot_dir) / f"step_{step}", safe_serialization=True)

    started = time.time()
    losses = warm_start(model, tokenizer, splits["train"], warm, on_step=checkpoint)
    report["train_seconds"] = round(time.time() - started, 1)
    if trajectory:
        report["trajectory"] = trajectory
    report["final_loss"] = round(sum(losses[-20:]) / min(20, len(losses)), 4)
    model.save_pretrained(out, safe_serialization=True)
    report["greedy"] = evaluate(model, tokenizer, splits["test"], do_sample=False, seed=seed)
    report["sampled"] = evaluate(model, tokenizer, splits["test"], do_sample=True, seed=seed)
    report["warm_start"] = asdict(warm)
    report["num_test"] = num_test
    return report


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory (HF layout)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start", action="store_true", help="supervised warm-up on the synthetic task")
    parser.add_argument("--steps", type=int, default=WarmStartConfig.steps)
    parser.add_argument("--num-test", type=int, default=200, help="held-out rows for the accuracy report")
    parser.add_argument("--eval-every", type=int, default=0, help="also measure accuracy every N warm-up steps")
    parser.add_argument("--snapshot-dir", default=None, help="save the model at every --eval-every step here")
    parser.add_argument("--override", action="append", default=[], metavar="KEY=INT",
                        help="model config override, e.g. --override num_hidden_layers=4 (repeatable)")
    parser.add_argument("--batch-size", type=int, default=WarmStartConfig.batch_size)
    parser.add_argument("--lr", type=float, default=WarmStartConfig.learning_rate)
    parser.add_argument("--levels", type=int, nargs="+", default=list(WarmStartConfig.levels),
                        help="arithmetic levels the warm-up trains on and the report covers")
    parser.add_argument("--direct-answer-levels", type=int, nargs="*",
                        default=list(WarmStartConfig.direct_answer_levels),
                        help="levels where part of the targets is the bare boxed answer instead of the worked steps")
    parser.add_argument("--direct-answer-fraction", type=float, default=WarmStartConfig.direct_answer_fraction)
    args = parser.parse_args(argv)
    warm = None
    if args.warm_start:
        warm = WarmStartConfig(steps=args.steps, batch_size=args.batch_size, learning_rate=args.lr, seed=args.seed,
                               levels=tuple(args.levels), direct_answer_levels=tuple(args.direct_answer_levels),
                               direct_answer_fraction=args.direct_answer_fraction)
    overrides = dict(QUICKSTART_OVERRIDES)
    for item in args.override:
        key, _, value = item.partition("=")
        if not value.isdigit():
            parser.error(f"--override {item!r} must be KEY=INT, e.g. num_hidden_layers=4")
        overrides[key] = int(value)
    started = time.time()
    report = make_tiny_model(Path(args.out), args.seed, warm, args.num_test, args.eval_every,
                             Path(args.snapshot_dir) if args.snapshot_dir else None, overrides)
    report["total_seconds"] = round(time.time() - started, 1)
    report["command"] = "python tools/make_tiny_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
    Path(args.out, "warm_start_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
