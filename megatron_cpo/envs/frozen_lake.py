"""FrozenLake as a text game (RAGEN's environment, Gym's rules): walk from S to G on a grid of ice and holes, one move
digit per turn in ``\\boxed{}``; reward 1 at G, 0 in a hole. ``write_frozen_lake_parquet`` writes boards in verl's
schema. Rules and numbering: docs/multi_turn.md, "Environments".
"""
from __future__ import annotations

import random
from collections import deque
from pathlib import Path
from typing import Any

from megatron_cpo.data.synthetic import write_parquet
from megatron_cpo.envs.base import StepResult, TextEnvironment, user
from megatron_cpo.rewards.math_answer import last_boxed

DATA_SOURCE = "megatron_cpo/frozen_lake"
MOVES = {"1": (0, -1), "2": (1, 0), "3": (0, 1), "4": (-1, 0)}
SIDEWAYS = {"1": "24", "2": "13", "3": "24", "4": "13"}
RULES = "Move with 1 (left), 2 (down), 3 (right) or 4 (up): answer one digit in \\boxed{}."


def board_text(grid: list[str], position: tuple[int, int]) -> str:
    rows = [list(row) for row in grid]
    rows[position[0]][position[1]] = "P"
    return "\n".join("".join(row) for row in rows)


def read_move(text: str) -> str | None:
    """The move of a turn: the first move digit in its last `\\boxed{}`, else in its text."""
    boxed = last_boxed(text)
    candidates = boxed if boxed is not None else text
    return next((char for char in candidates if char in MOVES), None)


class FrozenLakeEnvironment(TextEnvironment):
    """One game on the row's board (`extra_info.map`, rows of S F H G)."""

    def __init__(self, slippery: bool = False) -> None:
        self.slippery = slippery
        self.grid: list[str] = []
        self.position = (0, 0)
        self.rng = random.Random(0)

    def reset(self, record: Any, seed: int) -> list[dict]:
        self.grid = [str(row) for row in record.extra_info["map"]]
        self.position = next((r, c) for r, row in enumerate(self.grid) for c, cell in enumerate(row) if cell == "S")
        self.rng = random.Random(seed)
        return super().reset(record, seed)

    def step(self, action_text: str) -> StepResult:
        move = read_move(action_text)
        if move is None:
            return StepResult([user(f"That is not a move. {RULES}\n{board_text(self.grid, self.position)}")])
        if self.slippery and self.rng.random() < 2 / 3:
            move = self.rng.choice(SIDEWAYS[move])
        row = min(max(self.position[0] + MOVES[move][0], 0), len(self.grid) - 1)
        column = min(max(self.position[1] + MOVES[move][1], 0), len(self.grid[0]) - 1)
        self.position = (row, column)
        cell = self.grid[row][column]
        if cell == "G":
            return StepResult([], reward=1.0, done=True)
        if cell == "H":
            return StepResult([], reward=0.0, done=True)
        return StepResult([user(board_text(self.grid, self.position))])

    def score(self) -> float:
        """Nothing beyond the step rewards (1 at the goal): the game scores itself, no grader is needed."""
        return 0.0


def shortest_path(grid: list[str]) -> int | None:
    """Moves from S to G avoiding holes, or None when G cannot be reached."""
    size = (len(grid), len(grid[0]))
    start = next((r, c) for r, row in enumerate(grid) for c, cell in enumerate(row) if cell == "S")
    seen, queue = {start: 0}, deque([start])
    while queue:
        r, c = queue.popleft()
        if grid[r][c] == "G":
            return seen[(r, c)]
        for dr, dc in MOVES.values():
            nr, nc = r + dr, c + dc
            if 0 <= nr < size[0] and 0 <= nc < size[1] and grid[nr][nc] != "H" and (nr, nc) not in seen:
                seen[(nr, nc)] = seen[(r, c)] + 1
                queue.append((nr, nc))
    return None


def random_board(rng: random.Random, size: int, holes: int) -> list[str]:
    """A board with S in the top-left and G in the bottom-right corner and a path between them."""
    while True:
        cells = [["F"] * size for _ in range(size)]
        cells[0][0], cells[-1][-1] = "S", "G"
        free = [(r, c) for r in range(size) for c in range(size) if (r, c) not in ((0, 0), (size - 1, size - 1))]
        for r, c in rng.sample(free, holes):
            cells[r][c] = "H"
        grid = ["".join(row) for row in cells]
        if shortest_path(grid) is not None:
            return grid


def frozen_lake_row(grid: list[str], split: str, index: int) -> dict:
    prompt = f"FrozenLake: reach G, avoid H. P is you.\n{board_text(grid, (0, 0))}\n{RULES}"
    return {"data_source": DATA_SOURCE, "agent_name": "frozen_lake",
            "prompt": [{"role": "system", "content": "You play FrozenLake."}, {"role": "user", "content": prompt}],
            "ability": "game", "reward_model": {"style": "rule", "ground_truth": str(shortest_path(grid))},
            "extra_info": {"map": grid, "split": split, "index": index}}


def write_frozen_lake_parquet(out_dir: str | Path, num_train: int, num_test: int, size: int = 3, holes: int = 2,
                              seed: int = 0) -> dict[str, Path]:
    """`train.parquet` and `test.parquet` of distinct boards (test boards never in train, when the grid allows)."""
    rng = random.Random(f"frozen_lake-{seed}")
    test = [random_board(rng, size, holes) for _ in range(num_test)]
    held_out = {tuple(grid) for grid in test}
    train = []
    for _ in range(num_train):
        grid = random_board(rng, size, holes)
        for _ in range(100):
            if tuple(grid) not in held_out:
                break
            grid = random_board(rng, size, holes)
        train.append(grid)
    out = Path(out_dir)
    return {split: write_parquet([frozen_lake_row(g, split, i) for i, g in enumerate(grids)], out / f"{split}.parquet")
            for split, grids in (("train", train), ("test", test))}
