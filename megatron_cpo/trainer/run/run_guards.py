"""What keeps runs from mixing, and start-up from being left half done.

- `prepare_run_directory`: `trainer.resume=disable` into a directory that holds an earlier run would append to its
  metrics and leave its `latest` checkpoint in place (a later `resume=auto` would continue the wrong run), so it is
  refused unless `trainer.overwrite=true`, which moves the earlier run aside (archived, never deleted).
- `StartupSignal`: SIGTERM while the model loads and the engines start raises `RunAbortedError` in the main thread,
  so the normal unwinding stops the engines (and their worker processes) and the process exits with status 143;
  `StopSignal`: SIGTERM once training runs (SLURM preemption) lets the current step finish and be checkpointed.
- `engines_lost_message`, `rewards_refused_message`, `weights_not_finite_message`, `nothing_to_train_message`: the one
  line a run ends with when no rollout engine is left, when a reward is not finite (`reward.non_finite=error`), when
  the trainer's own weights are not finite (the sync check), or when not even its first batch could be formed.
"""
from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from megatron_cpo.config_checks import ConfigError
from megatron_cpo.trainer.config import TrainerConfig
from megatron_cpo.trainer.run.errors import RunAbortedError

logger = logging.getLogger(__name__)

SIGTERM_EXIT_CODE = 128 + signal.SIGTERM


def holds_earlier_run(out_dir: Path) -> bool:
    """Whether `out_dir` has metrics or checkpoints of a run."""
    checkpoints = out_dir / "checkpoints"
    metrics = out_dir / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or (checkpoints.is_dir() and any(checkpoints.iterdir()))


def mixing_problem(trainer: TrainerConfig) -> str | None:
    """Why this run would mix into an earlier one in `trainer.default_local_dir` (None when it would not)."""
    out_dir = Path(trainer.default_local_dir)
    if trainer.resume != "disable" or trainer.overwrite or not holds_earlier_run(out_dir):
        return None
    return (f"trainer.default_local_dir={out_dir} holds an earlier run and trainer.resume=disable would mix this run "
            "into it; choose a new trainer.default_local_dir, continue it with trainer.resume=auto, or set "
            "trainer.overwrite=true to archive it first")


def prepare_run_directory(trainer: TrainerConfig) -> Path | None:
    """Collective: refuse (ConfigError) or archive an earlier run in `trainer.default_local_dir` when this run starts
    fresh (`resume=disable`); returns the archive's path when one was made. Every rank decides the same."""
    out_dir = Path(trainer.default_local_dir)
    held = trainer.resume == "disable" and holds_earlier_run(out_dir)
    if dist.get_world_size() > 1:
        dist.barrier()  # every rank has looked before rank 0 moves anything
    if not held:
        return None
    if not trainer.overwrite:
        raise ConfigError(mixing_problem(trainer))
    archive = out_dir.with_name(f"{out_dir.name}.archived-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}")
    if dist.get_rank() == 0:
        out_dir.rename(archive)
        logger.warning("trainer.overwrite=true: moved the earlier run in %s to %s", out_dir, archive)
    if dist.get_world_size() > 1:
        dist.barrier()
    return archive


class StopSignal:
    """Remembers a SIGTERM (SLURM preemption) so the loop can checkpoint and stop after the current step."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        logger.warning("SIGTERM received: finishing this step, then checkpointing and stopping")
        self.received = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class StartupSignal:
    """While installed, SIGTERM interrupts the main thread; `run_training` turns whatever exception that surfaces as
    (the handler's KeyboardInterrupt, or an error of the C extension it interrupted) into `error()`, a
    `RunAbortedError` with exit status 143, after the normal unwinding stopped the engines. `check()` catches a
    signal whose exception some library swallowed. Ray's own handler (installed by `ray.init`, it calls `sys.exit`)
    is kept out by the rollout manager, which restores ours."""

    def __init__(self) -> None:
        self.received = False
        self._previous: Any = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.received:  # once: a second signal must not interrupt the clean-up the first one started
            self.received = True
            # a KeyboardInterrupt, because that is what Ray's blocking calls expect from a signal handler and pass on
            raise KeyboardInterrupt("SIGTERM during start-up")

    @staticmethod
    def error() -> RunAbortedError:
        return RunAbortedError("stopped by SIGTERM during start-up, before the first step; nothing was trained or "
                               "written (start the run again to train)", exit_code=SIGTERM_EXIT_CODE)

    def check(self) -> None:
        if self.received:
            raise self.error()

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


def engines_lost_message(failure: str | None, engines: tuple[int, int], step: int, checkpoint: Path | None,
                         last_step: bool = False) -> str:
    """One line: which engine died, what was kept, how to go on. `engines`: (alive, started); `last_step`: `step` ended
    the run (its last step, an early stop or the spent sample budget), so what is lost is its final validation (the
    push after it serves that), and resuming has nothing left to train."""
    alive, started = engines
    state = ("no rollout engine is left" if alive == 0 else
             f"a rollout engine died during the weight sync ({alive} of {started} left hold a partial update)")
    kept = (f"the {step} trained steps are in checkpoint {checkpoint}" if checkpoint is not None
            else "no step had been trained, nothing was written")
    lost, then = (("the run's final validation cannot run", "then validate that checkpoint with megatron-cpo eval "
                   "(after megatron-cpo convert-mcore-to-hf)") if last_step else
                  (f"step {step + 1} cannot be generated", "then continue with trainer.resume=auto"))
    return (f"{state} ({started} started; last failure: {failure or 'unknown'}), so {lost}; {kept}. Find the cause in "
            "that engine's log (often out of memory: lower actor_rollout_ref.rollout.kv_cache_gib or "
            "data.max_response_length, or run more engines with actor_rollout_ref.rollout.num_engines; "
            "actor_rollout_ref.rollout.engine_health sets how hung engines are found and how often they are "
            f"restarted), {then}")


def rewards_refused_message(refused: str, step: int, checkpoint: Path | None) -> str:
    """One line: the non-finite reward that stopped step `step` before its update (`refused`), and what was kept."""
    kept = (f"the training up to step {step - 1} is checkpointed in {checkpoint}" if checkpoint is not None
            else "nothing was trained")
    return f"step {step} stopped before its update: {refused}; {kept}"


def weights_not_finite_message(problem: str, last_checkpoint: Path | None) -> str:
    """One line: the sync check's `problem` with the trainer's own weights, and the checkpoint to go back to."""
    if last_checkpoint is None:
        return (f"{problem}; nothing was checkpointed from them, and no checkpoint was written before (check the "
                "model's weights in actor_rollout_ref.model.path)")
    return (f"{problem}; nothing was checkpointed from them, the last good checkpoint is {last_checkpoint} "
            "(trainer.resume=auto resumes from it)")


def nothing_to_train_message(train_batch_size: int) -> str:
    """Why a run that has not trained a single step stops (instead of exiting 0 with nothing done)."""
    return ("no training batch could be formed at step 1: the filters dropped every group before "
            f"data.train_batch_size={train_batch_size} were kept (e.g. every response scored the same "
            "because the ground truths are empty or the task is too easy/hard); check the data's "
            "reward_model.ground_truth and the grader, or relax algorithm.filter_groups / the rollout filter")
