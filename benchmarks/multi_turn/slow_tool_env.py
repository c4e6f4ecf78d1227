"""The two-try arithmetic environment (`arith_retry`) behind a slow tool: every step first waits a random 0 to
`max_latency_s` seconds (2 by default), as a tool call or a remote grader would, then answers as `arith_retry` does.

The wait is seeded by the episode's group seed, the try and the answer's text, so a rerun with the same seeds waits
the same times, and a run with another `trainer.seed` other times. Used by bench_async_episodes.py:

    actor_rollout_ref.rollout.multi_turn.default_agent=benchmarks/multi_turn/slow_tool_env.py:SlowToolArithmeticRetry
"""
from __future__ import annotations

import random
import time
from typing import Any

from megatron_cpo.envs import StepResult
from megatron_cpo.envs.arith_retry import ArithmeticRetryEnvironment


class SlowToolArithmeticRetry(ArithmeticRetryEnvironment):
    """`arith_retry` whose every step takes a seeded random 0-`max_latency_s` seconds first."""

    def __init__(self, max_latency_s: float = 2.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_latency_s = max_latency_s
        self.seed = 0

    def reset(self, record: Any, seed: int) -> list[dict]:
        self.seed = seed
        return super().reset(record, seed)

    def step(self, action_text: str) -> StepResult:
        wait = random.Random(f"{self.seed}:{self.attempts}:{action_text}").uniform(0.0, self.max_latency_s)
        time.sleep(wait)
        return super().step(action_text)
