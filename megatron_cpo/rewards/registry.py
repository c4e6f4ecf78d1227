"""Grader registry: one entry point with verl's signature, dispatching on ``data_source``.

A grader is any callable ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict | float``
returning at least ``score`` and ``acc`` (a bare number is wrapped: ``acc = score > 0``). Each registered grader also
declares ``failure_score``, the score a sample gets when the grader raises, hangs or crashes, which is that grader's
wrong-answer score. Users add graders with ``register_grader(source, "pkg.module:fn")`` or through
``RewardConfig.custom_graders``; adding a source touches one row of ``_BUILTIN_GRADERS``.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from megatron_cpo.rewards.answer_graders import (
    compute_geometry_score,
    compute_gsm8k_score,
    compute_multiple_choice_score,
)
from megatron_cpo.rewards.code_grader import compute_code_score
from megatron_cpo.rewards.math_grader import compute_math_score, compute_strict_math_score

ARITH_DATA_SOURCE = "megatron_cpo/arith"


@dataclass(frozen=True)
class Grader:
    """A grading function and the score a sample gets when the function fails (raises, hangs, crashes)."""

    fn: Callable[..., dict | float]
    failure_score: float
    name: str


def load_callable(dotted_path: str) -> Callable:
    """Import ``pkg.module:fn`` (or ``pkg.module.fn``); errors name the path and what is missing."""
    module_name, separator, attribute = dotted_path.partition(":")
    if not separator:
        module_name, _, attribute = dotted_path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"grader path {dotted_path!r} must look like 'pkg.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cannot import module {module_name!r} of grader {dotted_path!r}: {error}; "
                         "make sure it is on PYTHONPATH") from error
    function = getattr(module, attribute, None)
    if not callable(function):
        raise ValueError(f"module {module_name!r} has no callable {attribute!r} (grader {dotted_path!r})")
    return function


def _builtin(fn: Callable, failure_score: float) -> Grader:
    return Grader(fn=fn, failure_score=failure_score, name=fn.__name__)


_BUILTIN_GRADERS: dict[str, Grader] = {
    **{source: _builtin(compute_math_score, -1.0) for source in (
        "math", "hendrycks_math", "hendrycks_math:train_MATH-500:test", "math500", "HuggingFaceH4/MATH-500",
        ARITH_DATA_SOURCE)},
    **{source: _builtin(compute_strict_math_score, -1.0) for source in ("aime2024", "aime2025", "amc23")},
    "openai/gsm8k": _builtin(compute_gsm8k_score, 0.0),
    "gpqa": _builtin(compute_multiple_choice_score, 0.0),
    "hiyouga/geometry3k": _builtin(compute_geometry_score, 0.0),
    **{source: _builtin(compute_code_score, 0.0) for source in ("codecontests", "apps", "codeforces", "taco")},
}
_registered: dict[str, Grader] = dict(_BUILTIN_GRADERS)


def register_grader(data_source: str, grader: Callable | str, failure_score: float = 0.0,
                    overwrite: bool = False) -> Grader:
    """Register ``grader`` (a callable or a ``pkg.module:fn`` path) for ``data_source`` in this process."""
    function = load_callable(grader) if isinstance(grader, str) else grader
    if data_source in _registered and not overwrite:
        raise ValueError(f"data_source {data_source!r} already has grader {_registered[data_source].name!r}; "
                         "pass overwrite=True to replace it")
    entry = Grader(fn=function, failure_score=float(failure_score), name=grader if isinstance(
        grader, str) else getattr(function, "__qualname__", repr(function)))
    _registered[data_source] = entry
    return entry


def known_sources() -> list[str]:
    """Every data_source with a grader in this process, sorted."""
    return sorted(_registered)


def get_grader(data_source: str) -> Grader:
    """The grader for ``data_source``; an unknown source is an error listing the known ones."""
    grader = _registered.get(data_source)
    if grader is None:
        raise ValueError(f"no grader for data_source={data_source!r}; known sources: {', '.join(known_sources())}. "
                       "Register one with reward.custom_graders={'<source>': 'pkg.module:fn'}")
    return grader


def normalise_result(raw: dict | float | int | bool, grader_name: str) -> dict:
    """A grader's return value as a dict with float ``score`` and bool ``acc``."""
    if isinstance(raw, dict):
        if "score" not in raw:
            raise ValueError(f"grader {grader_name!r} returned a dict without 'score': keys {sorted(raw)}")
        result = dict(raw)
        result["score"] = float(result["score"])
        result["acc"] = bool(result.get("acc", result["score"] > 0))
    elif isinstance(raw, (int, float)):
        result = {"score": float(raw), "acc": float(raw) > 0}
    else:
        raise TypeError(f"grader {grader_name!r} returned {type(raw).__name__}; return a dict or a number")
    result.setdefault("pred", None)
    return result


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **grader_kwargs) -> dict:
    """Grade one response with the grader registered for ``data_source`` (verl's ``compute_score`` signature).

    Returns at least ``score`` (float), ``acc`` (bool), ``pred`` (the extracted answer) and, when wrong, ``reason``.
    ``grader_kwargs`` reach the grader, e.g. ``wrong_score=0.0`` for 1/0 math scores.
    """
    grader = get_grader(data_source)
    raw = grader.fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                    extra_info=extra_info, **grader_kwargs)
    return normalise_result(raw, grader.name)


def missing_graders(data_sources: Iterable[str]) -> list[str]:
    """The distinct data sources, sorted, that have no grader in this process (checked before a run starts)."""
    missing = set()
    for source in set(data_sources):
        try:
            get_grader(source)
        except ValueError:
            missing.add(source)
    return sorted(missing)
