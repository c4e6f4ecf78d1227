"""A synthetic arithmetic task in verl's parquet schema, sized for a tiny character-level model: short questions with
step-by-step gold solutions ending in `\\boxed{}` (CPO's hint), at difficulty levels that give RL mixed groups.
Deterministic in (seed, split); test questions are kept out of the train split (docs/data.md).
"""
from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DATA_SOURCE = "megatron_cpo/arith"
ABILITY = "math"
SYSTEM_PROMPT = "You are a calculator."
QUESTION_TEMPLATE = "Compute {expression}. Answer in \\boxed{{}}."


@dataclass(frozen=True)
class ArithProblem:
    """One question: the expression shown to the model, its gold step-by-step solution and the numeric answer."""

    expression: str
    solution: str
    answer: int


def _boxed(steps: list[str], answer: int) -> str:
    return "\n".join(steps + [f"\\boxed{{{answer}}}"])


def _column_addition(a: int, b: int) -> list[str]:
    """Steps of a two-digit column addition: ones with carry, then tens."""
    ones = a % 10 + b % 10
    carry = ones // 10
    tens = a // 10 + b // 10 + carry
    return [f"{a % 10}+{b % 10}={ones}", f"{a // 10}+{b // 10}+{carry}={tens}"]


def _level_1(rng: random.Random) -> ArithProblem:
    """One-digit addition."""
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return ArithProblem(f"{a}+{b}", _boxed([f"{a}+{b}={a + b}"], a + b), a + b)


def _level_2(rng: random.Random) -> ArithProblem:
    """Three one-digit operands, two additions."""
    a, b, c = rng.randint(1, 9), rng.randint(1, 9), rng.randint(1, 9)
    return ArithProblem(f"{a}+{b}+{c}", _boxed([f"{a}+{b}={a + b}", f"{a + b}+{c}={a + b + c}"], a + b + c), a + b + c)


def _level_3(rng: random.Random) -> ArithProblem:
    """Two-digit plus two-digit addition, solved by columns (carries)."""
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    return ArithProblem(f"{a}+{b}", _boxed(_column_addition(a, b), a + b), a + b)


def _level_4(rng: random.Random) -> ArithProblem:
    """One-digit multiplication followed by an addition."""
    a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
    return ArithProblem(f"{a}*{b}+{c}", _boxed([f"{a}*{b}={a * b}", f"{a * b}+{c}={a * b + c}"], a * b + c), a * b + c)


def _level_5(rng: random.Random) -> ArithProblem:
    """Two products summed: two multiplications and a two-digit addition."""
    a, b, c, d = (rng.randint(2, 9) for _ in range(4))
    p, q = a * b, c * d
    steps = [f"{a}*{b}={p}", f"{c}*{d}={q}", f"{p}+{q}={p + q}"]
    return ArithProblem(f"{a}*{b}+{c}*{d}", _boxed(steps, p + q), p + q)


LEVELS: dict[int, Callable[[random.Random], ArithProblem]] = {
    1: _level_1,
    2: _level_2,
    3: _level_3,
    4: _level_4,
    5: _level_5,
}


@dataclass
class ArithConfig:
    """What to generate: rows per split, the levels mixed in (uniformly, round-robin) and the seed."""

    num_train: int = 4000
    num_test: int = 200
    levels: list[int] = field(default_factory=lambda: sorted(LEVELS))
    seed: int = 0

    def __post_init__(self) -> None:
        unknown = [level for level in self.levels if level not in LEVELS]
        if unknown or not self.levels:
            raise ValueError(f"levels={self.levels} holds unknown levels {unknown}; choose from {sorted(LEVELS)}")
        if self.num_train < 0 or self.num_test < 0:
            raise ValueError(f"num_train={self.num_train}, num_test={self.num_test}: row counts must be >= 0")


def make_problem(level: int, rng: random.Random) -> ArithProblem:
    """Draw one problem of `level` from `rng`."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level}; choose from {sorted(LEVELS)}")
    return LEVELS[level](rng)


def make_row(problem: ArithProblem, level: int, split: str, index: int) -> dict:
    """A verl-schema row for one problem."""
    question = QUESTION_TEMPLATE.format(expression=problem.expression)
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        "ability": ABILITY,
        "reward_model": {"style": "rule", "ground_truth": str(problem.answer)},
        "extra_info": {"index": index, "split": split, "level": level, "solution": problem.solution},
    }


def _draw_split(config: ArithConfig, split: str, count: int, excluded: set[str]) -> list[tuple[int, ArithProblem]]:
    """`count` (level, problem) pairs cycling through the levels; an expression in `excluded` is redrawn (up to 100
    times, so a level with fewer distinct questions than the test split still terminates)."""
    rng = random.Random(f"{config.seed}-{split}")
    drawn = []
    for index in range(count):
        level = config.levels[index % len(config.levels)]
        problem = make_problem(level, rng)
        for _ in range(100):
            if problem.expression not in excluded:
                break
            problem = make_problem(level, rng)
        drawn.append((level, problem))
    return drawn


def generate_arith(config: ArithConfig) -> dict[str, list[dict]]:
    """Rows of both splits: {"train": [...], "test": [...]}; train avoids every test question where possible."""
    test = _draw_split(config, "test", config.num_test, excluded=set())
    train = _draw_split(config, "train", config.num_train, excluded={problem.expression for _, problem in test})
    return {
        split: [make_row(problem, level, split, index) for index, (level, problem) in enumerate(drawn)]
        for split, drawn in (("train", train), ("test", test))
    }


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    """Write verl-schema rows to one parquet file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arith_parquet(out_dir: str | Path, config: ArithConfig | None = None,
                        keep_levels: list[int] | None = None) -> dict[str, Path]:
    """Generate the task and write `train.parquet` and `test.parquet` under `out_dir`; returns their paths.

    `keep_levels` writes only rows of those levels from the full generation, so the rows (and the held-out property
    of the test split) are exactly those a model warm-started on the full task saw or did not see.
    """
    config = config or ArithConfig()
    if keep_levels is not None and (not keep_levels or set(keep_levels) - set(config.levels)):
        raise ValueError(f"keep_levels={keep_levels} must be a non-empty subset of levels={config.levels}")
    splits = generate_arith(config)
    if keep_levels is not None:
        splits = {name: [r for r in rows if r["extra_info"]["level"] in keep_levels] for name, rows in splits.items()}
    return {name: write_parquet(rows, Path(out_dir) / f"{name}.parquet") for name, rows in splits.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the synthetic arithmetic task as verl-schema parquet files.")
    parser.add_argument("--out", required=True, help="directory for train.parquet and test.parquet")
    parser.add_argument("--num-train", type=int, default=ArithConfig.num_train)
    parser.add_argument("--num-test", type=int, default=ArithConfig.num_test)
    parser.add_argument("--levels", type=int, nargs="+", default=sorted(LEVELS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-levels", type=int, nargs="+", default=None,
                        help="write only these levels of the generated splits (e.g. 1 2 for the tiny quickstart)")
    args = parser.parse_args(argv)
    config = ArithConfig(args.num_train, args.num_test, args.levels, args.seed)
    for name, path in write_arith_parquet(args.out, config, args.keep_levels).items():
        print(f"wrote {name}: {path}")


if __name__ == "__main__":
    main()
