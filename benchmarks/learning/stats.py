"""Small-sample statistics for the learning table: mean, sample standard deviation and a t-distribution 95% interval,
and the paired (same seed) difference of two algorithms. Pure functions, no SciPy (the t quantiles are tabulated)."""
from __future__ import annotations

import math
from dataclasses import dataclass

# Two-sided 95% quantiles t_{0.975, df} of Student's t for df = 1..30 (standard tables); larger df use 1.96.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width of a 95% interval in standard errors for `df` degrees of freedom."""
    if df < 1:
        raise ValueError(f"df={df}: a t interval needs at least 2 values (df >= 1)")
    return T_975[df - 1] if df <= len(T_975) else 1.96


@dataclass(frozen=True)
class Summary:
    """n values: their mean, sample standard deviation (n-1) and 95% t interval (nan bounds when n < 2)."""

    n: int
    mean: float
    std: float
    low: float
    high: float

    def excludes_zero(self) -> bool:
        return self.n >= 2 and (self.low > 0 or self.high < 0)


def summarize(values: list[float]) -> Summary:
    """Mean, std (ddof 1) and the interval mean +- t_{0.975, n-1} * std / sqrt(n)."""
    n = len(values)
    if n == 0:
        raise ValueError("no values to summarize")
    mean = sum(values) / n
    if n == 1:
        return Summary(1, mean, math.nan, math.nan, math.nan)
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile_975(n - 1) * std / math.sqrt(n)
    return Summary(n, mean, std, mean - half, mean + half)


def paired_difference(a: dict[int, float], b: dict[int, float]) -> tuple[Summary, list[int]]:
    """Summary of a[seed] - b[seed] over the seeds both have, and those seeds (sorted)."""
    seeds = sorted(set(a) & set(b))
    if not seeds:
        raise ValueError(f"no seed in common: {sorted(a)} vs {sorted(b)}")
    return summarize([a[seed] - b[seed] for seed in seeds]), seeds


def binomial_se(p: float, n: int) -> float:
    """One standard error of an accuracy p measured on n questions: sqrt(p (1 - p) / n)."""
    return math.sqrt(p * (1 - p) / n)


def verdict(difference: Summary, name: str, other: str) -> str:
    """How to read a paired interval: which way it excludes zero, or that it does not."""
    if difference.n < 2:
        return "one seed only: no interval"
    if difference.low > 0:
        return f"{name} better than {other} (interval above 0)"
    if difference.high < 0:
        return f"{name} worse than {other} (interval below 0)"
    return "no difference shown (interval includes 0)"
