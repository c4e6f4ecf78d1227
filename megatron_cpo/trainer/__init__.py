"""The training loop: rank-0 filter-accumulate controller, Megatron actor and reference, the step, checkpoints.

One step, in reading order: `loop.py` (`Trainer.step`, the list of ARCHITECTURE.md), `rank_zero.py` (rank 0's
data, engines, validation and logging), `controller.py` + `accumulator.py` (how a batch is filled from streaming
rollouts), `collectives.py` (the batch broadcast, the weight push, every other collective), `step.py` (log-probs,
advantages, CPO shaping, PPO update), `actor.py` (Megatron forward/backward), `checkpointing.py`.
Entry points: `megatron-cpo train --config ...` and `run_training(config)`.
"""
from megatron_cpo.trainer.loop import Trainer, run_training

__all__ = ["Trainer", "run_training"]
