"""Multi-digit addition asked in plain words, for a real instruct model (the SmolLM2-135M-Instruct example).

No system prompt or format instruction; graded on the response's last number; each row carries a worked column
solution as CPO's hint; the test split's questions are kept out of the train split (docs/data.md).

    python -m megatron_cpo.data.addition --out outputs/addition
"""
from __future__ import annotations

import argparse
import random
from dataclasses import dataclass
from pathlib import Path

from megatron_cpo.data.synthetic import write_parquet

DATA_SOURCE = "megatron_cpo/addition"
QUESTION_TEMPLATE = "What is {a} + {b}?"
PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands", "hundred-thousands")


@dataclass(frozen=True)
class AdditionConfig:
    """Rows per split, the operands' digit count and the seed."""

    num_train: int = 4000
    num_test: int = 400
    digits: int = 2
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.digits < len(PLACES):
            raise ValueError(f"digits={self.digits} must be in [1, {len(PLACES) - 1}]")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(f"num_train={self.num_train}, num_test={self.num_test}: row counts must be >= 0")
        distinct = (9 * 10 ** (self.digits - 1)) ** 2 // 2
        if self.num_test > distinct // 2:
            raise ValueError(f"num_test={self.num_test} is too many for {self.digits}-digit operands (about "
                             f"{distinct} distinct questions); lower it below {distinct // 2}")


def worked_solution(a: int, b: int) -> str:
    """Column addition in words: one line per place with its digits and carry, then the sum."""
    lines, carry, place = [], 0, 0
    while a // 10 ** place or b // 10 ** place:
        x, y = a // 10 ** place % 10, b // 10 ** place % 10
        total = x + y + carry
        terms = f"{x} + {y}" + (f" + {carry}" if carry else "")
        line = f"Add the {PLACES[place]}: {terms} = {total}."
        carry = total // 10
        more = a // 10 ** (place + 1) or b // 10 ** (place + 1)
        if carry and more:
            line += f" Write {total % 10} and carry {carry}."
        lines.append(line)
        place += 1
    lines.append(f"So {a} + {b} = {a + b}.")
    return "\n".join(lines)


def make_row(a: int, b: int, split: str, index: int) -> dict:
    """A verl-schema row: the plain question, the sum as ground truth, the worked solution as the hint."""
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": QUESTION_TEMPLATE.format(a=a, b=b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"index": index, "split": split, "solution": worked_solution(a, b)},
    }


def _question(a: int, b: int) -> tuple[int, int]:
    return min(a, b), max(a, b)  # a + b and b + a are one question


def _draw(config: AdditionConfig, split: str, count: int, excluded: set[tuple[int, int]], distinct: bool
          ) -> list[tuple[int, int]]:
    """`count` operand pairs whose question is not in `excluded` (and, if `distinct`, each question once)."""
    rng = random.Random(f"{config.seed}-{split}")
    low, high = 10 ** (config.digits - 1), 10 ** config.digits - 1
    seen, pairs = set(), []
    while len(pairs) < count:
        a, b = rng.randint(low, high), rng.randint(low, high)
        if _question(a, b) in excluded or (distinct and _question(a, b) in seen):
            continue
        seen.add(_question(a, b))
        pairs.append((a, b))
    return pairs


def generate_addition(config: AdditionConfig) -> dict[str, list[dict]]:
    """Rows of both splits: {"train": [...], "test": [...]}; test questions are distinct and none is trained on."""
    test = _draw(config, "test", config.num_test, excluded=set(), distinct=True)
    train = _draw(config, "train", config.num_train, excluded={_question(a, b) for a, b in test}, distinct=False)
    return {split: [make_row(a, b, split, index) for index, (a, b) in enumerate(pairs)]
            for split, pairs in (("train", train), ("test", test))}


def write_addition_parquet(out_dir: str | Path, config: AdditionConfig | None = None) -> dict[str, Path]:
    """Generate the task and write `train.parquet` and `test.parquet` under `out_dir`; returns their paths."""
    splits = generate_addition(config or AdditionConfig())
    return {name: write_parquet(rows, Path(out_dir) / f"{name}.parquet") for name, rows in splits.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the plain-words addition task as verl-schema parquet files.")
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--num-train", type=int, default=AdditionConfig.num_train)
    parser.add_argument("--num-test", type=int, default=AdditionConfig.num_test)
    parser.add_argument("--digits", type=int, default=AdditionConfig.digits)
    parser.add_argument("--seed", type=int, default=AdditionConfig.seed)
    args = parser.parse_args(argv)
    config = AdditionConfig(args.num_train, args.num_test, args.digits, args.seed)
    for name, path in write_addition_parquet(args.out, config).items():
        print(f"wrote {name}: {path}")


if __name__ == "__main__":
    main()
