"""Uncertainty of accuracies and paired comparisons of two methods on the same samples
(no SciPy)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import NamedTuple


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion: ``k`` successes of ``n`` trials (z = 1.96: 95%).

    With p = k/n: (p + z²/2n ± z √(p(1−p)/n + z²/4n²)) / (1 + z²/n), clipped to [0, 1]. A fractional
    ``k`` (a sum of partial scores) is treated as the proportion p of n answers.
    """
    if n < 1:
        raise ValueError(f"n={n!r} must be at least 1")
    if not 0 <= k <= n:
        raise ValueError(f"k={k!r} must lie in [0, n={n}]")
    p, zz = k / n, z * z
    center = (p + zz / (2 * n)) / (1 + zz / n)
    half = z * math.sqrt(p * (1 - p) / n + zz / (4 * n * n)) / (1 + zz / n)
    return max(0.0, center - half), min(1.0, center + half)


def sign_test(wins: int, losses: int) -> float:
    """Two-sided exact sign test: with m = wins + losses untied pairs and j = min(wins, losses),
    p = min(1, 2 Σ_{i≤j} C(m, i) / 2^m) (Binomial(m, ½)); 1 when there are no untied pairs."""
    if wins < 0 or losses < 0:
        raise ValueError(f"wins={wins!r} and losses={losses!r} must be non-negative")
    m = wins + losses
    tail = sum(math.comb(m, i) for i in range(min(wins, losses) + 1))
    return min(1.0, 2 * tail / 2**m)


class Paired(NamedTuple):
    """A method against a baseline on the same samples.

    Fields:
        wins: the method right, the baseline wrong.
        losses: the reverse.
        ties: both right or both wrong.
        p: the sign test's p over the untied pairs.
    """

    wins: int
    losses: int
    ties: int
    p: float


def paired(baseline: Mapping[str, float], method: Mapping[str, float]) -> Paired:
    """Compare two methods' scores (sample id -> score in [0, 1]; a score of 1 is a right answer)
    over the same samples."""
    if set(baseline) != set(method):
        raise ValueError(
            f"baseline and method must score the same samples; only in baseline: "
            f"{sorted(set(baseline) - set(method))[:3]}, only in method: "
            f"{sorted(set(method) - set(baseline))[:3]}"
        )
    for name, scores in (("baseline", baseline), ("method", method)):
        if bad := [s for s in scores.values() if not 0 <= s <= 1]:
            raise ValueError(f"{name}: scores must lie in [0, 1], got {bad[0]!r}")
    wins = sum(method[s] == 1 and baseline[s] != 1 for s in baseline)
    losses = sum(method[s] != 1 and baseline[s] == 1 for s in baseline)
    return Paired(wins, losses, len(baseline) - wins - losses, sign_test(wins, losses))
