"""The training loop: `loop.py` is the step, the same on every rank; around it three sides, each its own package.

- `driver/`: one interface on every rank (`interface.py`): rank 0's `LeadDriver` (the prompt stream, the
  filter-accumulate controller and its admission rule, grading, the batch it builds, validation, the loggers) does
  the work and broadcasts its decisions, the other ranks' `FollowerDriver` receives them;
- `workers/` (every rank): the Megatron actor and reference, the log-prob / advantage / update steps, the weight
  push and the sync probe's scoring;
- `collectives.py`: what all ranks call together (broadcasts, the batch's broadcast), under both sides;
- `batch/`: the batch a step trains on and its sequence layout (ragged rows, packing, micro-batches), which both
  sides build on;
- `run/`: the run's plumbing (preflight, the process layout, run-directory guards, checkpoints and resume, errors).
`assemble.py` is the composition root (`run_training`); `config.py` holds the trainer's sections (`actor.*`,
`ref.*`, `trainer.*`, `async_training.*`); `command.py` is `megatron-cpo train`. One step, in reading order:
`loop.py` (`Trainer.step`, the numbered list of docs/architecture.md), `driver/lead.py`, `driver/controller.py`,
`workers/policy_update.py`, `workers/actor.py`, `run/checkpointing.py`.
Entry points: `megatron-cpo train --config ...` and `run_training(config)`.

`Trainer` and `run_training` load on first use, so that the trainer's config sections (`trainer/config.py`) load
without Megatron.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {"assemble": ("Trainer", "run_training")})
