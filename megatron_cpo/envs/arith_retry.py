"""Arithmetic with feedback (verl's GSM8K interaction as a text environment over megatron_cpo/data/synthetic.py): the
last `\\boxed{}` number (or `#### n`) of a turn is compared by value with the ground truth; a right first answer
earns 1, a right later one `retry_reward`, a wrong one 0 and the feedback message, within
`multi_turn.max_assistant_turns` tries. The environment scores itself: success is a right answer within the tries.
"""
from __future__ import annotations

from decimal import Decimal, InvalidOperation
from typing import Any

from megatron_cpo.envs.base import StepResult, TextEnvironment, user
from megatron_cpo.rewards.answer_graders import extract_gsm8k_answer


def same_number(answer: str | None, truth: str) -> bool:
    if answer is None:
        return False
    try:
        return Decimal(answer) == Decimal(str(truth).strip())
    except InvalidOperation:
        return False


class ArithmeticRetryEnvironment(TextEnvironment):
    """One question of the row (`reward_model.ground_truth`), answered until right or out of turns."""

    def __init__(self, retry_reward: float = 0.5, feedback: str = "Wrong. Try again.") -> None:
        self.retry_reward, self.feedback = retry_reward, feedback
        self.truth = ""
        self.attempts = 0

    def reset(self, record: Any, seed: int) -> list[dict]:
        self.truth, self.attempts = str(record.ground_truth), 0
        return super().reset(record, seed)

    def step(self, action_text: str) -> StepResult:
        self.attempts += 1
        if same_number(extract_gsm8k_answer(action_text), self.truth):
            return StepResult([], reward=1.0 if self.attempts == 1 else self.retry_reward, done=True,
                              info={"attempts": self.attempts})
        return StepResult([user(self.feedback)])

    def score(self) -> float:
        """Nothing beyond the step rewards: the environment grades every answer itself."""
        return 0.0
