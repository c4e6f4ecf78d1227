"""The training loop: rank-0 filter-accumulate controller, Megatron actor and reference, the step, checkpoints.

Read in this order: `loop.py` (the run, one step per iteration), `controller.py` + `accumulator.py` (how a batch is
filled from streaming rollouts), `step.py` (log-probs, advantages, CPO shaping, PPO update), `actor.py` (Megatron
forward/backward), `checkpointing.py`, `loggers.py`. Entry points: `megatron-cpo train --config ...` and
`run_training(config)`.
"""
from megatron_cpo.trainer.loop import run_training

__all__ = ["run_training"]
