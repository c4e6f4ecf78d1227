"""Non-finite rewards (NaN, +-inf) are stopped where they enter: never trained as they are.

Each source checks its scores once where they arrive; a refused score becomes 0 with a description, and
``reward.non_finite`` (applied in trainer/driver/grading.py) decides: stop the run or train it as 0 (docs/data.md).
"""
from __future__ import annotations

from collections.abc import Callable

import torch


class NonFiniteRewardError(ValueError):
    """A reward source gave a non-finite score and `reward.non_finite=error`; one line naming it and the fix."""


def screen_scores(scores: torch.Tensor, describe: Callable[[int, float], str]
                  ) -> tuple[torch.Tensor, dict[int, str]]:
    """`scores` [N] with every non-finite entry replaced by 0, and what each replaced one was:
    {index: describe(index, value)} (empty when all are finite)."""
    bad = ~torch.isfinite(scores)
    if not bool(bad.any()):
        return scores, {}
    refused = {index: describe(index, float(scores[index])) for index in bad.nonzero().flatten().tolist()}
    return torch.where(bad, torch.zeros_like(scores), scores), refused


def refusal_message(descriptions: list[str]) -> str:
    """One line: the first refused score, how many more there were, and the two ways on."""
    more = f" (and {len(descriptions) - 1} more non-finite score(s) in this batch)" if len(descriptions) > 1 else ""
    return (f"{descriptions[0]}{more}: a non-finite reward cannot be trained; make the reward source return finite "
            "numbers, or set reward.non_finite=zero to train such scores as 0 (counted in reward/non_finite)")


def source_row(row: object, data_source: str) -> str:
    """How a description names a sample: the row's index in its data file and its data source."""
    return f"row {row} (data_source {data_source!r})"
