"""The built-in text environments: FrozenLake (moves, goal, holes, walls, unreadable moves, Gym's slippery ice drawn
from the episode's seed, boards with a path, held-out boards) and two-try arithmetic (rewards by try)."""
import pyarrow.parquet as pq

from megatron_cpo.data.dataset import PromptRecord
from megatron_cpo.envs.arith_retry import ArithmeticRetryEnvironment
from megatron_cpo.envs.frozen_lake import (
    FrozenLakeEnvironment,
    board_text,
    read_move,
    shortest_path,
    write_frozen_lake_parquet,
)


def lake(grid: list[str]) -> PromptRecord:
    return PromptRecord(uid="", index=0, messages=[{"role": "user", "content": board_text(grid, (0, 0))}],
                        prompt_ids=[1], data_source="megatron_cpo/frozen_lake", ground_truth="2",
                        extra_info={"map": grid})


def test_frozen_lake_walks_falls_and_reaches_the_goal():
    env = FrozenLakeEnvironment()
    assert env.reset(lake(["SF", "HG"]), seed=0) == [{"role": "user", "content": "PF\nHG"}]
    assert read_move("I go right: \\boxed{3}") == "3" and read_move("\\boxed{7}") is None and read_move("4") == "4"
    wall = env.step("\\boxed{4}")  # up, into the wall: stays
    assert (wall.done, wall.messages[0]["content"]) == (False, "PF\nHG")
    unreadable = env.step("\\boxed{9}")
    assert not unreadable.done and unreadable.messages[0]["content"].startswith("That is not a move.")
    right = env.step("\\boxed{3}")
    assert right.messages[0]["content"] == "SP\nHG"
    goal = env.step("\\boxed{2}")
    assert (goal.done, goal.reward) == (True, 1.0) and env.score() == 0.0
    env.reset(lake(["SF", "HG"]), seed=0)
    hole = env.step("\\boxed{2}")
    assert (hole.done, hole.reward) == (True, 0.0)


def test_slippery_ice_is_drawn_from_the_episode_seed():
    def walk(seed: int) -> list[str]:
        env = FrozenLakeEnvironment(slippery=True)
        env.reset(lake(["SFFF", "FFFF", "FFFF", "FFFG"]), seed)
        return [env.step("3").messages[0]["content"] if not env.position == (3, 3) else "G" for _ in range(5)]
    assert walk(1) == walk(1) and any(walk(seed) != walk(1) for seed in range(2, 6))


def test_boards_have_a_path_and_held_out_boards_stay_out_of_training(tmp_path):
    paths = write_frozen_lake_parquet(tmp_path, num_train=30, num_test=5, size=3, holes=2)
    train, test = (pq.read_table(paths[split]).to_pylist() for split in ("train", "test"))
    assert all(row["agent_name"] == "frozen_lake" for row in train + test)
    assert all(shortest_path(row["extra_info"]["map"]) == int(row["reward_model"]["ground_truth"]) for row in train)
    assert not {tuple(r["extra_info"]["map"]) for r in test} & {tuple(r["extra_info"]["map"]) for r in train}


def test_arithmetic_retry_pays_less_for_a_second_try():
    row = PromptRecord(uid="", index=0, messages=[{"role": "user", "content": "Compute 2+3."}], prompt_ids=[1],
                       data_source="megatron_cpo/arith", ground_truth="5")
    env = ArithmeticRetryEnvironment(retry_reward=0.5)
    env.reset(row, 0)
    assert env.step("\\boxed{5}").reward == 1.0
    env.reset(row, 0)
    wrong = env.step("2+3=6\n\\boxed{6}")
    assert (wrong.done, wrong.reward) == (False, 0.0)
    assert wrong.messages == [{"role": "user", "content": "Wrong. Try again."}]
    right = env.step("\\boxed{5.0}")
    assert (right.done, right.reward) == (True, 0.5) and env.score() == 0.0
