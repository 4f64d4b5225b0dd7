"""An exact solver on small search spaces: an integer program over one choice per decision group.

Each group chooses one option: stay as it is, or one of its legal actions at the root (tile one
dim on one mesh axis). With tactics, one more decision comes first: which composition of the
tactic macros (one per mesh axis, or none) to start from, the plans :class:`search.MCTS` seeds
its tree with; the groups' options then refine it. The cost model is evaluated for every single
choice and every pair of choices of two decisions; the step time (and the peak memory and bytes
sent, for the budget and a ceiling) of a combination is then ``root + sum of single effects +
sum of pairwise interactions``, which is exact when no three choices interact beyond their pairs
(always, with two decisions). The integer program (scipy's ``milp``, HiGHS) minimises that time
under the budget (and the ceiling), with the usual linearisation of the pair products. Every
solution is evaluated with the real cost model; one that is over the budget or slower than the
model said is cut off (a no-good cut) and the program solved again, until the model's optimum is
no better than the best real plan. The result is never worse than any combination evaluated
exactly (the root, every single option and pair), and it fits the budget whenever one of those
or a solution does. ``max_evaluations`` bounds the size: larger spaces raise :class:`TooLarge`.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Sequence

import numpy as np

from automap.shardings import ShardingState
from search.base import SearchResult, SearchStats
from search.ceiling import Ceiling
from search.greedy import replay
from search.space import GroupAction, SearchSpace

OPTIMAL = "optimal under the pairwise cost model"  # the note of a result the solver proved


class TooLarge(ValueError):
    """The space needs more cost-model evaluations than the exact solver is allowed."""


Option = tuple  # the moves one choice makes: () leaves the group as it is


def options(space: SearchSpace) -> list[list[Option]]:
    """Per decision: () (leave it) and each alternative, as the moves it makes. With tactics
    (a space with a context) the first decision is the tactic composition, one of those
    :class:`search.MCTS` seeds its tree with (applied first, so group actions refine it); then
    per group, each legal action of the group at the root."""
    from search.mcts import tactic_compositions

    legal = [a for a in space.legal(space.root) if isinstance(a, GroupAction)]
    groups = [[()] + [(a,) for a in legal if a.group == g] for g in range(len(space.groups))]
    compositions = tactic_compositions(space, limit=4 ** len(space.axes))
    return ([[()] + compositions] if compositions else []) + groups


def apply_all(space: SearchSpace, choice: Sequence[Option]) -> ShardingState:
    """Apply the chosen options in decision order; a move that an earlier one already decided
    (propagation tiled that dim, or took its axis) is skipped: the earlier decision stands."""
    return replay(space, tuple(m for option in choice for m in option))[0]


@dataclasses.dataclass(frozen=True)
class ILP:
    """The exact solver (for spaces up to ``max_evaluations`` cost-model evaluations).

    >>> import search
    >>> search.ILP().name
    'ilp'
    """

    max_evaluations: int = 4000
    max_rounds: int = 16  # integer programs solved, each cutting off a plan the real model rejects
    time_limit_s: float = 30.0  # for all the solves together: then the best plan found stands
    ceiling: Ceiling | None = None  # bytes sent and memory a plan may not exceed (as MCTS holds to)
    name: str = "ilp"

    def search(self, space: SearchSpace) -> SearchResult:
        from scipy.optimize import LinearConstraint, milp

        t0 = time.perf_counter()
        opts = options(space)
        groups = [g for g, o in enumerate(opts) if len(o) > 1]
        needed = sum(len(opts[g]) - 1 for g in groups) + sum(
            (len(opts[g]) - 1) * (len(opts[h]) - 1) for g, h in itertools.combinations(groups, 2)
        )
        if needed > self.max_evaluations:
            raise TooLarge(f"the exact solver would need {needed} cost evaluations (max_evaluations="
                           f"{self.max_evaluations}): use search.MCTS, or fewer decision groups")
        base = space.score(space.root)
        t_root, m_root, w_root = base.time_s, base.peak_bytes, base.estimate.wire_bytes
        ceiling = self.ceiling

        def effect(*chosen: tuple[int, Option]) -> tuple[float, float, float]:
            s = space.score(apply_all(space, _choice(len(opts), chosen)))
            return s.time_s - t_root, s.peak_bytes - m_root, s.estimate.wire_bytes - w_root

        def improves(got, best) -> bool:
            return _improves(got, best, ceiling)

        # variables: x[g, option] one-hot per decision, then y[pair] for pairs of non-empty options
        index: dict[tuple[int, Option], int] = {}
        for g in groups:
            for o in opts[g]:
                index[(g, o)] = len(index)
        single = {(g, o): effect((g, o)) for g in groups for o in opts[g][1:]}
        pairs, tried = [], []
        for g, h in itertools.combinations(groups, 2):
            for a in opts[g][1:]:
                for b in opts[h][1:]:
                    both = effect((g, a), (h, b))
                    tried.append(((g, a), (h, b)))
                    extra = tuple(x - single[(g, a)][i] - single[(h, b)][i] for i, x in enumerate(both))
                    if abs(extra[0]) > 1e-12 * t_root or abs(extra[1]) >= 1 or abs(extra[2]) >= 1:
                        pairs.append(((g, a), (h, b)) + extra)  # they interact: a pair variable
        n = len(index) + len(pairs)
        cost, mem, wire = np.zeros(n), np.zeros(n), np.zeros(n)
        for key, (t, m, w) in single.items():
            cost[index[key]], mem[index[key]], wire[index[key]] = t, m, w
        rows, lo, hi = [], [], []
        for g in groups:  # one option per group
            row = np.zeros(n)
            for o in opts[g]:
                row[index[(g, o)]] = 1
            rows.append(row), lo.append(1), hi.append(1)
        for k, (ka, kb, t, m, w) in enumerate(pairs):
            y = len(index) + k
            cost[y], mem[y], wire[y] = t, m, w
            for kx in (ka, kb):  # y <= x
                row = np.zeros(n)
                row[y], row[index[kx]] = 1, -1
                rows.append(row), lo.append(-np.inf), hi.append(0)
            row = np.zeros(n)  # y >= xa + xb - 1
            row[y], row[index[ka]], row[index[kb]] = 1, -1, -1
            rows.append(row), lo.append(-1), hi.append(np.inf)
        limits = [b for b in (space.memory_budget, ceiling and ceiling.peak_bytes) if b is not None]
        if limits:
            rows.append(mem), lo.append(-np.inf), hi.append(min(limits) - m_root)
        if ceiling is not None:
            rows.append(wire), lo.append(-np.inf), hi.append(ceiling.wire_bytes * (1 + 1e-9) + 1e-6 - w_root)
        # the pairwise model is exact only without higher-order interactions: start from the best
        # combination evaluated exactly (the root, every single option and pair), then solve;
        # a solution that the real cost model finds over budget or no better is cut off
        # (a no-good cut on its one-hot assignment) and the program solved again
        state, score, actions = space.root, base, ()
        for combo in [((g, o),) for g in groups for o in opts[g][1:]] + tried:
            cand = apply_all(space, _choice(len(opts), combo))
            got = space.score(cand)
            if improves(got, score):
                state, score, actions = cand, got, tuple(m for _, o in combo for m in o)
        rounds, proved = 0, False
        for rounds in range(1, self.max_rounds + 1):
            left = self.time_limit_s - (time.perf_counter() - t0)
            if left <= 0:
                break
            result = milp(cost, constraints=LinearConstraint(np.array(rows), lo, hi), integrality=np.ones(n),
                          bounds=(0, 1), options={"time_limit": left})
            if result.x is None:
                proved = result.status == 2  # infeasible: no combination left that the model thinks fits
                break
            chosen = [(g, o) for (g, o), i in index.items() if result.x[i] > 0.5]
            combo = tuple((g, o) for g, o in chosen if o)
            cand = apply_all(space, _choice(len(opts), combo))
            got = space.score(cand)
            if improves(got, score):
                state, score, actions = cand, got, tuple(m for _, o in combo for m in o)
            if _fits(score, ceiling) and t_root + result.fun >= score.time_s * (1 - 1e-9):
                proved = result.status == 0  # the model's optimum is no better than the best real plan: done
                break
            row = np.zeros(n)  # no-good cut: never this assignment again
            for key in chosen:
                row[index[key]] = 1
            rows.append(row), lo.append(-np.inf), hi.append(len(chosen) - 1)
        stats = SearchStats(rounds, space.evaluations, time.perf_counter() - t0, space.eval_time_s)
        note = OPTIMAL if proved else (f"not proved optimal: stopped after {rounds} integer programs in "
                                       f"{stats.wall_time_s:.1f} s (max_rounds={self.max_rounds}, "
                                       f"time_limit_s={self.time_limit_s})")
        return SearchResult(state, score, actions, stats, self.name, (note,))


def brute_force(space: SearchSpace, ceiling: Ceiling | None = None) -> tuple[float, tuple[Option, ...]]:
    """The best step time over every combination of options (for testing the solver)."""
    best = (float("inf"), ())
    for choice in itertools.product(*options(space)):
        s = space.score(apply_all(space, choice))
        if _fits(s, ceiling) and s.time_s < best[0]:
            best = (s.time_s, choice)
    return best


def _choice(n_decisions: int, chosen: Sequence[tuple[int, Option]]) -> tuple[Option, ...]:
    choice: list[Option] = [()] * n_decisions
    for g, option in chosen:
        choice[g] = option
    return tuple(choice)


def _fits(score, ceiling: Ceiling | None) -> bool:
    return score.feasible and (ceiling is None or ceiling.admits(score))


def _improves(got, best, ceiling: Ceiling | None = None) -> bool:
    """Feasible (and under the ceiling) beats not; among those, the faster (ties: the first found)."""
    if _fits(got, ceiling) != _fits(best, ceiling):
        return _fits(got, ceiling)
    return got.time_s < best.time_s if _fits(got, ceiling) else got.peak_bytes < best.peak_bytes
