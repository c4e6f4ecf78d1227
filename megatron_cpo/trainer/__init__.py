"""The training loop: `loop.py` is the step, the same on every rank, built by `assemble.py` (`run_training`); around
it `driver/` (rank 0's work behind one interface on every rank), `workers/` (models and the step's math on every
rank), `batch/` (the step's batch and its layout) and `run/` (preflight, layout, checkpoints). The map:
docs/architecture.md. `Trainer` and `run_training` load on first use, so the config sections load without Megatron.
"""
from megatron_cpo.lazy_exports import lazy_exports

__all__, __getattr__, __dir__ = lazy_exports(__name__, {"assemble": ("Trainer", "run_training")})
