"""The tasks of the learning table: train and held-out parquet files, generated deterministically at run time.

Both come from `megatron_cpo.data.synthetic` (seed 0, the generation the shipped tiny model was warm-started on).

`arith12` (the shipped task, levels 1-2): only 100 distinct level-1 questions (`a+b`, one digit each) and 729 level-2
questions (`a+b+c`, digits 1-9) exist, and the warm start saw 66 and 481 of them, so just 282 level-1/2 questions
(34 + 248) were never seen by the model. The held-out set is those 282 (`data_source` `megatron_cpo/arith`) plus 118
level-2 questions the warm start saw, chosen by a fixed shuffle and removed from the RL train file
(`megatron_cpo/arith_sftseen`, graded by the same math grader through `reward.custom_graders`): 400 questions,
disjoint from the RL train file, none of them trained on by RL. `val/acc` is over all 400;
`val/megatron_cpo/arith/acc` over the 282 never seen at all.

`arith123` (the harder variant): the same plus level 3 (`ab+cd`, solved by columns), which the warm start never saw.
Train: the level-1/2 train rows of `arith12` and the 800 level-3 train rows; held-out: the 400 of `arith12` plus the
distinct level-3 questions of a 1000-question test draw (195 of its 200; `megatron_cpo/arith_level3`, same grader),
595 in all.

The plan of the table is here too (`TABLES`, `ALGOS`, `plan`: which run, with which config and overrides, in which
order), so that `run_table.py`, which runs it, and `summarize.py`, which reports on it, both read it from one place.
"""
from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_cpo.data.synthetic import ArithConfig, generate_arith, make_problem, make_row, write_parquet

ARITH_SOURCE = "megatron_cpo/arith"
SFT_SEEN_SOURCE = "megatron_cpo/arith_sftseen"
LEVEL3_SOURCE = "megatron_cpo/arith_level3"
MATH_GRADER = "megatron_cpo.rewards.math_grader:compute_math_score"
HELD_OUT_SIZE = 400
TASKS = ("arith12", "arith123")
HERE = Path(__file__).resolve().parent


def _expression(row: dict) -> str:
    return row["prompt"][1]["content"]


def _never_seen(level: int, seen: set[str], index_start: int) -> list[dict]:
    """Every question of `level` not in `seen`, in a fixed order (enumerated, not sampled: the space is small)."""
    if level == 1:
        operands = [(a, b) for a in range(10) for b in range(10)]
    else:
        operands = [(a, b, c) for a in range(1, 10) for b in range(1, 10) for c in range(1, 10)]
    rows = []
    for values in operands:
        problem = make_problem(level, _Fixed(values))
        row = make_row(problem, level, "test", index_start + len(rows))
        if _expression(row) not in seen:
            rows.append(row)
    return rows


class _Fixed(random.Random):
    """A `random.Random` whose `randint` returns given values in order, so `make_problem` builds a chosen question
    with the generator's own wording and gold solution."""

    def __init__(self, values: tuple[int, ...]) -> None:
        super().__init__(0)
        self._values = list(values)

    def randint(self, a: int, b: int) -> int:  # noqa: D102 - same contract, fixed values
        value = self._values.pop(0)
        if not a <= value <= b:
            raise ValueError(f"fixed operand {value} outside [{a}, {b}]")
        return value


def arith12_rows() -> dict[str, list[dict]]:
    """{"train": RL train rows, "test": the 400 held-out rows} of the shipped task (see the module docstring)."""
    splits = generate_arith(ArithConfig())
    train = [row for row in splits["train"] if row["extra_info"]["level"] in (1, 2)]
    seen = {_expression(row) for row in train}
    test = _never_seen(1, seen, 0) + _never_seen(2, seen, 1000)
    seen_level2 = sorted({_expression(row) for row in train if row["extra_info"]["level"] == 2})
    random.Random(0).shuffle(seen_level2)
    moved = set(seen_level2[:HELD_OUT_SIZE - len(test)])
    moved_rows = {}
    for row in train:
        if _expression(row) in moved and _expression(row) not in moved_rows:
            moved_rows[_expression(row)] = {**row, "data_source": SFT_SEEN_SOURCE,
                                            "extra_info": {**row["extra_info"], "split": "test"}}
    test += [moved_rows[expression] for expression in sorted(moved_rows)]
    train = [row for row in train if _expression(row) not in moved]
    return {"train": train, "test": test}


def arith123_rows() -> dict[str, list[dict]]:
    """The harder variant: `arith12` plus level 3 in train and held-out (see the module docstring)."""
    base = arith12_rows()
    wide = generate_arith(ArithConfig(num_test=1000))
    level3_test, held_out = [], set()
    for row in wide["test"]:
        if row["extra_info"]["level"] == 3 and _expression(row) not in held_out:
            level3_test.append({**row, "data_source": LEVEL3_SOURCE})
            held_out.add(_expression(row))
    level3_train = [row for row in generate_arith(ArithConfig())["train"]
                    if row["extra_info"]["level"] == 3 and _expression(row) not in held_out]
    return {"train": base["train"] + level3_train, "test": base["test"] + level3_test}


def write_task(task: str, out_dir: str | Path) -> dict[str, Path]:
    """Write `train.parquet` and `test.parquet` of `task` under `out_dir`; returns their paths."""
    builders = {"arith12": arith12_rows, "arith123": arith123_rows}
    if task not in builders:
        raise ValueError(f"unknown task {task!r}; choose from {sorted(builders)}")
    rows = builders[task]()
    return {name: write_parquet(split, Path(out_dir) / f"{name}.parquet") for name, split in rows.items()}


def task_overrides(task: str) -> list[str]:
    """Trainer overrides every run of `task` needs: the extra held-out sources graded like the arithmetic task."""
    sources = [SFT_SEEN_SOURCE] + ([LEVEL3_SOURCE] if task == "arith123" else [])
    return [f"reward.custom_graders.{source}={MATH_GRADER}" for source in sources]


SEEDS = (1, 2, 3)
STEPS = 40


# The OPD rows' teacher: one longer GRPO run on `arith12` (seed 0, no table seed), its final policy kept as a Hugging
# Face directory (not committed: run_table.py makes it when missing). 100 steps: table (a)'s GRPO gains ~30 points
# in 40, so the teacher is well above the warm start the students begin from.
TEACHER_SEED, TEACHER_STEPS = 0, 100
TEACHER_MODEL = HERE / "runs" / "arith12" / "teacher" / f"seed{TEACHER_SEED}" / "model"
# On-policy distillation (docs/distillation.md) as benchmarks/real_model/compare_cpo.py's OPD arms: k1 as a
# policy-gradient reward, sampling at temperature 1 (the teacher scores at 1; the tiny examples sample at 1 anyway).
OPD_K1 = ("distillation.enabled=true", "distillation.nnodes=0", "distillation.distillation_loss.loss_mode=k1",
          "distillation.distillation_loss.use_policy_gradient=true", "actor_rollout_ref.rollout.temperature=1.0")
ENGINE_TEACHER = f"distillation.teacher_models.teacher_model.model_path={TEACHER_MODEL}"


@dataclass(frozen=True)
class Algo:
    """A table column: the example config it starts from and extra overrides (the CPO rule); `keeps_model`: the
    run's final policy is kept as `<out_dir>/model` (the teacher); `needs_teacher`: it distils from that teacher."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    keeps_model: bool = False
    needs_teacher: bool = False


ALGOS = {
    "grpo": Algo("grpo", "examples/tiny/grpo_arith.yaml"),
    "dapo": Algo("dapo", "examples/tiny/dapo_arith.yaml"),
    "cpo": Algo("cpo", "examples/tiny/cpo_arith.yaml", ("algorithm.wrap_method=negonly_mi3",)),
    **{f"cpo_{rule}": Algo(f"cpo_{rule}", "examples/tiny/cpo_arith.yaml", (f"algorithm.wrap_method={rule}",))
       for rule in ("naive", "mi3", "mi_clamp_unify_difficulty", "tok_kl")},
    # asynchronous training, one weight version of staleness at most (docs/async.md; the correction is on by default)
    "grpo_k1": Algo("grpo_k1", "examples/tiny/grpo_arith.yaml", ("async_training.max_staleness=1",)),
    "dapo_k1": Algo("dapo_k1", "examples/tiny/dapo_arith.yaml", ("async_training.max_staleness=1",)),
    "cpo_k1": Algo("cpo_k1", "examples/tiny/cpo_arith.yaml",
                   ("algorithm.wrap_method=negonly_mi3", "async_training.max_staleness=1")),
    # verl's other estimators and loss modes (docs/algorithms.md), each on GRPO's example otherwise unchanged
    "ppo": Algo("ppo", "examples/tiny/ppo_arith.yaml"),
    "rloo": Algo("rloo", "examples/tiny/grpo_arith.yaml", ("algorithm.adv_estimator=rloo",)),
    "reinforce_plus_plus": Algo("reinforce_plus_plus", "examples/tiny/grpo_arith.yaml",
                                ("algorithm.adv_estimator=reinforce_plus_plus",)),
    # GSPO's sequence-level ratio with its own clip ranges and aggregation (the GSPO paper's and verl's recipe)
    "gspo": Algo("gspo", "examples/tiny/grpo_arith.yaml", (
        "actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor_rollout_ref.actor.clip_ratio_low=0.0003",
        "actor_rollout_ref.actor.clip_ratio_high=0.0004", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean")),
    # the OPD rows' teacher (validated every 20 steps: its curve shows it did not collapse before the kept step)
    "teacher": Algo("teacher", "examples/tiny/grpo_arith.yaml", ("trainer.test_freq=20",), keeps_model=True),
    # on-policy distillation from the teacher's own vLLM engine, without and with the task reward, and
    # self-distillation (the policy given the gold solution, CPO's hint context with the tiny task's instruction)
    "opd": Algo("opd", "examples/tiny/grpo_arith.yaml",
                (*OPD_K1, "distillation.distillation_loss.use_task_rewards=false", ENGINE_TEACHER), needs_teacher=True),
    "opd_task": Algo("opd_task", "examples/tiny/grpo_arith.yaml",
                     (*OPD_K1, "distillation.distillation_loss.use_task_rewards=true", ENGINE_TEACHER),
                     needs_teacher=True),
    "opsd": Algo("opsd", "examples/tiny/grpo_arith.yaml",
                 (*OPD_K1, "distillation.distillation_loss.use_task_rewards=false",
                  "distillation.teacher_models.teacher_model.kind=self")),
}

# table -> (task, algorithms); priority order.
TABLES = {
    "a": ("arith12", ("grpo", "dapo", "cpo")),
    "b": ("arith123", ("grpo", "cpo", "dapo")),
    "c": ("arith12", ("cpo_naive", "cpo_mi3", "cpo_mi_clamp_unify_difficulty", "cpo_tok_kl")),
    "d": ("arith12", ("grpo_k1", "dapo_k1", "cpo_k1")),
    "e": ("arith12", ("ppo", "rloo", "reinforce_plus_plus", "gspo")),
    "f": ("arith12", ("grpo", "opd", "opd_task", "opsd")),  # GRPO: table (a)'s runs (same directory, skipped)
}


@dataclass(frozen=True)
class Run:
    table: str
    task: str
    algo: str
    seed: int
    steps: int

    @property
    def out_dir(self) -> Path:
        return HERE / "runs" / self.task / self.algo / f"seed{self.seed}"

    def command(self) -> list[str]:
        algo = ALGOS[self.algo]
        data = HERE / "runs" / self.task / "data"
        return [sys.executable, "-m", "megatron_cpo.cli", "train", "--config", algo.config,
                f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
                f"trainer.default_local_dir={self.out_dir}", "trainer.resume=disable", f"trainer.seed={self.seed}",
                f"trainer.total_training_steps={self.steps}", f"trainer.test_freq={self.steps}",
                f"trainer.experiment_name={self.task}_{self.algo}_seed{self.seed}",
                "actor_rollout_ref.rollout.ray_address=local", *algo.overrides, *task_overrides(self.task)]


TEACHER_RUN = Run("f", "arith12", "teacher", TEACHER_SEED, TEACHER_STEPS)


def plan(only: list[str], seeds: tuple[int, ...], steps: dict[str, int]) -> list[Run]:
    """The runs in execution order; `only` entries are `table`, `table:algo` or `table:algo:seed`."""
    runs = []
    for table, (task, algos) in TABLES.items():
        for seed in seeds:
            for algo in algos:
                run = Run(table, task, algo, seed, steps.get(table, STEPS))
                keys = {table, f"{table}:{algo}", f"{table}:{algo}:{seed}"}
                if not only or keys & set(only):
                    runs.append(run)
    return runs
