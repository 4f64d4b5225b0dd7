"""The one objective that orders plans, for every stage of the search, the exact solver, the
expert ceiling and the tests.

A plan that fits the per-device memory budget (and, when there is one, the expert ceiling, see
:mod:`search.ceiling`) beats one that does not; among plans that fit, the faster estimated step
wins. Plans that do not fit are ordered by their shaped value: the reward (root time over the
plan's time) scaled down by ``(budget / peak) ** 2`` over the budget and by the ceiling's shaping
above it, so a search climbs back under both. That is :meth:`Objective.key`: one sort key,
lower is better, and :meth:`Objective.value` is what a tree search backs up.

Step-time estimates closer than ``tolerance`` are below the cost model's resolution, while bytes
sent and memory are what it predicts best; so the answer is chosen (:meth:`Objective.choose`)
among the fitting plans within ``tolerance`` of the fastest as the one that sends the fewest
bytes (within ``tolerance``), then holds the least memory. With an anchor (the fastest expert plan), a plan in that
band replaces it only when clearly leaner.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

from search.ceiling import Ceiling
from search.space import Plan, Score


@dataclasses.dataclass(frozen=True)
class Objective:
    """Orders plans: fitting (budget, ceiling) first, then faster; ties within ``tolerance`` of
    the fastest go to fewer bytes sent, then less memory.

    >>> import types
    >>> def score(time_s, wire, peak, feasible=True):
    ...     est = types.SimpleNamespace(wire_bytes=wire)
    ...     return types.SimpleNamespace(time_s=time_s, reward=1 / time_s, peak_bytes=peak, feasible=feasible,
    ...                                  estimate=est)
    >>> fast, lean, big = score(1.000, 100.0, 10), score(1.005, 50.0, 10), score(0.5, 100.0, 99, feasible=False)
    >>> o = Objective(tolerance=0.01)
    >>> o.better(fast, lean), o.better(lean, big)  # strictly by time among fitting plans; fitting first
    (True, True)
    >>> plans = [Plan(name, s, ()) for name, s in (("fast", fast), ("lean", lean), ("big", big))]
    >>> o.choose(plans).state, Objective(tolerance=0.0).choose(plans).state  # a near tie: the leaner
    ('lean', 'fast')
    >>> Objective(ceiling=Ceiling(wire_bytes=60.0, peak_bytes=10)).choose(plans).state  # fast is above it
    'lean'
    """

    tolerance: float = 0.01
    ceiling: Ceiling | None = None

    def fits(self, score: Score) -> bool:
        """Within the memory budget and under the ceiling."""
        return score.feasible and (self.ceiling is None or self.ceiling.admits(score))

    def value(self, score: Score) -> float:
        """Higher is better: the reward, shaped down above the ceiling (what a tree backs up)."""
        return score.reward if self.ceiling is None else self.ceiling.shaped(score)

    def key(self, score: Score) -> tuple:
        """Sort key, lower is better: fitting the budget, then under the ceiling, then the value
        (for fitting plans: the faster)."""
        return (not score.feasible, not (self.ceiling is None or self.ceiling.admits(score)), -self.value(score))

    def better(self, a: Score, b: Score | None) -> bool:
        """Whether ``a`` is strictly better than ``b`` (anything beats None)."""
        return b is None or self.key(a) < self.key(b)

    def best(self, plans: Iterable[Plan]) -> Plan | None:
        """The best plan by :meth:`key` (the first of equals), or None for no plans."""
        return min(plans, key=lambda p: self.key(p.score), default=None)

    def choose(self, plans: Iterable[Plan], anchor: Plan | None = None) -> Plan | None:
        """The answer among ``plans``: the best by :meth:`key` unless a fitting plan within
        ``tolerance`` of its time sends fewer bytes (bytes within ``tolerance`` of the fewest
        count as equal; among those, the least memory, then the fastest); with ``anchor`` in
        that band, the anchor unless a plan is clearly leaner (``tolerance`` fewer bytes and no
        more memory, or ``tolerance`` less memory and no more bytes)."""
        plans = list(plans) + ([anchor] if anchor is not None else [])
        best = self.best(plans)
        if best is None or self.tolerance <= 0 or not self.fits(best.score):
            return best
        limit = best.score.time_s * (1 + self.tolerance)
        band = [p for p in plans if self.fits(p.score) and p.score.time_s <= limit]
        if anchor is not None and self.fits(anchor.score) and anchor.score.time_s <= limit:
            wire, peak, tol = anchor.score.estimate.wire_bytes, anchor.score.peak_bytes, self.tolerance
            band = [anchor] + [p for p in band if (lean_by(p, wire, peak, tol))]
        fewest = min(p.score.estimate.wire_bytes for p in band)  # bytes within tolerance of the fewest are equal
        band = [p for p in band if p.score.estimate.wire_bytes <= fewest * (1 + self.tolerance) + 1e-6]
        return min(band, key=lambda p: (p.score.peak_bytes, p.score.time_s))


def lean_by(plan: Plan, wire: float, peak: int, tolerance: float) -> bool:
    """``tolerance`` fewer bytes than ``wire`` and no more memory than ``peak``, or the reverse."""
    w, p = plan.score.estimate.wire_bytes, plan.score.peak_bytes
    return (w <= wire * (1 - tolerance) and p <= peak) or (p <= peak * (1 - tolerance) and w <= wire)
