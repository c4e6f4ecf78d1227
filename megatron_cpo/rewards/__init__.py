"""Verifiable rewards: graders, the ``compute_score`` registry, the parallel reward manager, the remote reward model."""
from megatron_cpo.rewards.registry import (
    ARITH_DATA_SOURCE,
    Grader,
    compute_score,
    get_grader,
    known_sources,
    load_callable,
    register_grader,
)

__all__ = ["ARITH_DATA_SOURCE", "Grader", "compute_score", "get_grader", "known_sources", "load_callable",
           "register_grader"]
