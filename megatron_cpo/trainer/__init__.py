"""The training loop: rank-0 filter-accumulate controller, Megatron actor and reference, the step, checkpoints.

One step, in reading order: `loop.py` (`Trainer.step`, the numbered list of docs/architecture.md), `rank_zero.py`
(rank 0's data, engines, validation and logging), `controller.py` + `accumulator.py` (how a batch is filled from
streaming rollouts), `step_batch.py` (the batch rank 0 broadcasts), `collectives.py` (the batch broadcast, the weight
push, every other collective), `policy_update.py` (log-probs, advantages, CPO shaping, PPO update), `actor.py`
(Megatron forward/backward), `checkpointing.py`. `config.py` holds the trainer's sections (`actor.*`, `ref.*`,
`trainer.*`).
Entry points: `megatron-cpo train --config ...` and `run_training(config)`.

`Trainer` and `run_training` load on first use, so that the trainer's config sections (`trainer/config.py`) load
without Megatron.
"""
import importlib

__all__ = ["Trainer", "run_training"]


def __getattr__(name: str) -> object:
    if name in __all__:
        return getattr(importlib.import_module("megatron_cpo.trainer.loop"), name)
    raise AttributeError(f"module 'megatron_cpo.trainer' has no attribute {name!r}")
