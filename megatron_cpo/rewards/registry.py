"""Grader registry: one entry point with verl's signature, dispatching on ``data_source``.

A grader is ``fn(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> dict | float`` with its
``failure_score`` and verl-valued ``defaults``; adding a source is one row of ``_BUILTIN_GRADERS``. The sources,
their scores and where ours is more lenient than verl: docs/data.md, "Graders by data source".
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from megatron_cpo.import_paths import import_callable
from megatron_cpo.rewards.answer_graders import (
    compute_geometry_score,
    compute_gsm8k_score,
    compute_last_number_score,
    compute_multiple_choice_score,
)
from megatron_cpo.rewards.code_grader import compute_code_score
from megatron_cpo.rewards.config import RewardConfig
from megatron_cpo.rewards.dataset_graders import compute_dapo_score, compute_qa_exact_match_score
from megatron_cpo.rewards.math_grader import compute_math_score, compute_strict_math_score

ARITH_DATA_SOURCE = "megatron_cpo/arith"
ADDITION_DATA_SOURCE = "megatron_cpo/addition"  # data/addition.py: plain-words questions, the last number answers


@dataclass(frozen=True)
class Grader:
    """A grading function and the score a sample gets when the function fails (raises, hangs, crashes)."""

    fn: Callable[..., dict | float]
    failure_score: float
    name: str
    defaults: dict = field(default_factory=dict)


def _builtin(fn: Callable, failure_score: float, **defaults) -> Grader:
    return Grader(fn=fn, failure_score=failure_score, name=fn.__name__, defaults=defaults)


VERL_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")
NUMINA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc",
                  "numina_cn_k12", "numina_olympiads")
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")
SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))

_BUILTIN_GRADERS: dict[str, Grader] = {
    **{source: _builtin(compute_math_score, -1.0) for source in (
        "hendrycks_math", "hendrycks_math:train_MATH-500:test", "math500", ARITH_DATA_SOURCE)},
    **{source: _builtin(compute_math_score, 0.0, wrong_score=0.0, require_boxed=True) for source in VERL_MATH_SOURCES},
    **{source: _builtin(compute_dapo_score, -1.0) for source in DAPO_SOURCES},
    **{source: _builtin(compute_math_score, 0.0, wrong_score=0.0) for source in NUMINA_SOURCES},
    "amc23": _builtin(compute_strict_math_score, -1.0),
    "openai/gsm8k": _builtin(compute_gsm8k_score, 0.0),
    ADDITION_DATA_SOURCE: _builtin(compute_last_number_score, 0.0),
    "gpqa": _builtin(compute_multiple_choice_score, 0.0),
    "hiyouga/geometry3k": _builtin(compute_geometry_score, 0.0),
    **{source: _builtin(compute_code_score, 0.0, continuous=True, max_tests=10) for source in CODE_SOURCES},
    **{source: _builtin(compute_qa_exact_match_score, 0.0) for source in SEARCH_R1_SOURCES},
}
# verl grades every source whose name starts with one of these prefixes alike (``data_source.startswith("aime")``).
_PREFIX_GRADERS: dict[str, Grader] = {"aime": _builtin(compute_dapo_score, -1.0, strict=True)}
_registered: dict[str, Grader] = dict(_BUILTIN_GRADERS)
def register_grader(data_source: str, grader: Callable | str, failure_score: float = 0.0,
                    overwrite: bool = False) -> Grader:
    """Register ``grader`` (a callable or a ``pkg.module:fn`` path) for ``data_source`` in this process."""
    function = import_callable(grader, f"reward.custom_graders[{data_source!r}]") if isinstance(grader, str) else grader
    if data_source in _registered and not overwrite:
        raise ValueError(f"data_source {data_source!r} already has grader {_registered[data_source].name!r}; "
                         "pass overwrite=True to replace it")
    entry = Grader(fn=function, failure_score=float(failure_score), name=grader if isinstance(
        grader, str) else getattr(function, "__qualname__", repr(function)))
    _registered[data_source] = entry
    return entry


def register_custom_graders(custom_graders: dict[str, str], failure_score: float = 0.0) -> None:
    """Register ``reward.custom_graders`` (``{data_source: "pkg.module:fn" | "file.py:fn"}``) in this process,
    replacing built-ins of the same name. Each grading worker does this once at start; the trainer's process never
    does (its data check reads ``reward.custom_graders`` as it is, ``sources_without_grader``)."""
    for source, path in custom_graders.items():
        register_grader(source, path, failure_score=failure_score, overwrite=True)


def known_sources() -> list[str]:
    """Every data_source with a grader in this process, sorted (prefix rules shown as ``aime*``)."""
    return sorted([*_registered, *(f"{prefix}*" for prefix in _PREFIX_GRADERS)])


def _lookup(data_source: str) -> Grader | None:
    grader = _registered.get(data_source)
    if grader is None:
        grader = next((g for prefix, g in _PREFIX_GRADERS.items() if data_source.startswith(prefix)), None)
    return grader


def missing_graders(data_sources: Iterable[str]) -> list[str]:
    """The distinct sources among ``data_sources`` with no grader in this process (register custom graders first),
    sorted; empty when every source can be graded."""
    return sorted({str(source) for source in data_sources if _lookup(str(source)) is None})


def sources_without_grader(reward: RewardConfig, data_sources: Iterable[str]) -> list[str]:
    """The distinct sources among ``data_sources`` that nothing in the ``reward`` section grades, sorted: none with
    a ``reward_function``, else those with neither a ``custom_graders`` entry nor a registered grader."""
    if reward.reward_function:
        return []
    return missing_graders(source for source in data_sources if source not in reward.custom_graders)


def missing_grader_message(missing: list[str], where: str | None = None) -> str:
    """One line naming the sources without a grader (and the files they are in) and the two ways to fix it."""
    example = missing[0]
    return (f"no grader for data_source {', '.join(map(repr, missing))}{f' in {where}' if where else ''}; set "
            f"reward.custom_graders={{'{example}': 'pkg.module:fn'}} (one source) or custom_reward_function.path="
            f"<file.py> with custom_reward_function.name=<fn> (every source), or use one of the known sources: "
            f"{', '.join(known_sources())}")


def get_grader(data_source: str) -> Grader:
    """The grader for ``data_source``; an unknown source is an error listing the known ones."""
    grader = _lookup(data_source)
    if grader is None:
        raise ValueError(missing_grader_message([data_source]))
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


def compute_score(data_source: str, solution_str: str, ground_truth, extra_info: dict | None = None,
                  **grader_kwargs) -> dict:
    """Grade one response with the grader registered for ``data_source`` (verl's ``compute_score`` signature).

    Returns at least ``score`` (float), ``acc`` (bool), ``pred`` (the extracted answer) and, when wrong, ``reason``.
    ``grader_kwargs`` reach the grader over its source's defaults, e.g. ``wrong_score=0.0`` for 1/0 math scores.
    """
    grader = get_grader(data_source)
    raw = grader.fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                    extra_info=extra_info, **{**grader.defaults, **grader_kwargs})
    return normalise_result(raw, grader.name)

