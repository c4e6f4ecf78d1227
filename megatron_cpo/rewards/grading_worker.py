"""A grading worker process of ``GraderPool`` (``pool.py``): ``python -m megatron_cpo.rewards.grading_worker <fd>``.

It reads its settings, then grading tasks, from the socket ``fd`` and answers each with the grader's result or the
error it raised; it imports the grader registry and the code sandbox (no torch). Kept apart from the pool so that the
pool, which the symbolic check of the math grader also uses, does not depend on the graders.
"""
from __future__ import annotations

import resource
import sys
from multiprocessing.connection import Connection

from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards.registry import compute_score, normalise_result, register_custom_graders
from megatron_cpo.rewards.sandbox import configure_sandbox
from megatron_cpo.rewards.sandbox_types import SandboxConfig


def serve(connection: Connection, custom_graders: dict[str, str], custom_reward_function: str | None,
          grader_kwargs: dict[str, dict], memory_limit_mb: int | None,
          sandbox_settings: SandboxConfig | None = None) -> None:
    """Grade tasks received on ``connection`` until it sends None."""
    if sandbox_settings is not None:  # the code sandbox's backend (the probe of ``auto`` runs on first use)
        configure_sandbox(sandbox_settings, resolve=False)

    if memory_limit_mb:  # soft limit only: sandboxed children set their own, possibly larger, limits
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit_mb << 20, resource.getrlimit(resource.RLIMIT_AS)[1]))
    register_custom_graders(custom_graders)  # this worker's registry: the one place they are registered
    override = (import_callable(custom_reward_function, "reward.custom_reward_function") if custom_reward_function
                else None)
    connection.send("ready")
    while True:
        message = connection.recv()
        if message is None:
            return
        data_source, solution_str, ground_truth, extra_info = message
        kwargs = grader_kwargs.get(data_source, {})
        try:
            if override is not None:
                raw = override(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                               extra_info=extra_info, **kwargs)
                result = normalise_result(raw, custom_reward_function)
            else:
                result = compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)
            connection.send(("ok", result, ""))
        except Exception as error:  # a grader bug must cost one sample, not the batch
            connection.send(("error", None, f"{type(error).__name__}: {error}"[:500]))


if __name__ == "__main__":
    _channel = Connection(int(sys.argv[1]))
    try:
        serve(_channel, *_channel.recv())
    except (EOFError, ConnectionError):  # the trainer exited without closing the pool (it reports its own error)
        sys.exit(0)
