"""The pairwise cost model of :mod:`search.ilp` around one start, as a mixed-integer program.

The step time (peak memory, bytes sent) of a combination of options is the start's, plus each
option's effect alone, plus each interacting pair's correction; the latencies of collectives XLA
combines are taken out of the effects and priced once per combine group (see :mod:`search.ilp`'s
docstring for why and how the program is solved).
"""
from __future__ import annotations

import itertools

import numpy as np

from search.ceiling import Ceiling
from search.objective import Objective
from search.space import Move, Score, SearchSpace

Option = tuple  # the moves one choice makes: () leaves the group as it is
RESOLUTION = 1e-6  # plans faster by less than this fraction count as no faster


class PairwiseModel:
    """The pairwise cost model around one start, as a mixed-integer program: ``opts`` per
    decision group (:func:`search.ilp.options`), ``consider(moves, keep=False)`` the real cost
    model's score of the plan ``moves`` make from the root.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost import Topology
    >>> from automap.shardings import ShardingState
    >>> from search.greedy import replay
    >>> from search.ilp import options
    >>> prog = lower(jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((8, 8)), jnp.ones((8, 8))), ["w", "x"], ["y"])
    >>> space = SearchSpace(ShardingState.initial(prog, {"data": 2}), topology=Topology.preset("cpu-sim"))
    >>> consider = lambda moves, keep=False: space.score(replay(space, moves)[0])
    >>> model = PairwiseModel(space, (), options(space, space.root), None, consider)
    >>> model.value({}) == space.score(space.root).time_s  # every group as it is: the start's time
    True
    """

    def __init__(self, space: SearchSpace, start: tuple[Move, ...], opts: list[list[Option]],
                 ceiling: Ceiling | None, consider) -> None:
        self.start, self.ceiling, self.budget = start, ceiling, space.memory_budget
        base = consider(start)
        self.base = (base.time_s, base.peak_bytes, base.estimate.wire_bytes)
        fixed = latencies(space, base)  # combine groups that pay their latency already
        self.groups = [g for g, o in enumerate(opts) if len(o) > 1]
        self.index = {(g, o): i for i, (g, o) in enumerate((g, o) for g in self.groups for o in opts[g])}
        latency: dict[tuple, float] = dict(fixed)  # combine group -> the latency it pays once

        def effect(*chosen: tuple[int, Option]) -> tuple[np.ndarray, set, set]:
            """The change in time without the combine groups' latencies, memory and bytes sent;
            the combine groups the choice opens, and those of the start it closes. A single
            option's state is kept: the pairs with it start from it."""
            s = consider(start + tuple(m for _, o in chosen for m in o), keep=len(chosen) == 1)
            paid = latencies(space, s)
            for k, t in paid.items():
                latency[k] = max(latency.get(k, 0.0), t)
            own = np.array([s.time_s - sum(paid.values()), s.peak_bytes, s.estimate.wire_bytes])
            return own - self.base + [sum(fixed.values()), 0, 0], set(paid) - set(fixed), set(fixed) - set(paid)

        single = {(g, o): effect((g, o)) for g in self.groups for o in opts[g][1:]}
        extra: dict[tuple, np.ndarray] = {}
        # option or pair -> the combine groups it opens (+1) or closes (-1) that its parts do not
        flips: dict[tuple, dict[tuple, int]] = {}
        for k, (_, opened, closed) in single.items():
            flips[k] = {**dict.fromkeys(opened, 1), **dict.fromkeys(closed, -1)}
        for g, h in itertools.combinations(self.groups, 2):
            for a in opts[g][1:]:
                for b in opts[h][1:]:
                    both, opened, closed = effect((g, a), (h, b))
                    e = both - single[(g, a)][0] - single[(h, b)][0]
                    parts = set(flips[(g, a)]) | set(flips[(h, b)])
                    new = {**dict.fromkeys(opened - parts, 1), **dict.fromkeys(closed - parts, -1)}
                    if new:
                        flips[((g, a), (h, b))] = new
                    if new or abs(e[0]) > 1e-12 * self.base[0] or abs(e[1]) >= 1 or abs(e[2]) >= 1:
                        extra[((g, a), (h, b))] = e  # they interact
        columns: list = list(self.index)  # x[g, o]; y[a, b] for every option pair of interacting groups
        coef = [single[k][0] if k in single else np.zeros(3) for k in columns]
        eq_rows: list[dict[int, float]] = [{self.index[(g, o)]: 1.0 for o in opts[g]} for g in self.groups]
        for g, h in sorted({(ka[0], kb[0]) for ka, kb in extra}):
            marginal: dict[tuple, dict[int, float]] = {}
            for a in opts[g]:
                for b in opts[h]:
                    columns.append(((g, a), (h, b)))
                    coef.append(extra.get(((g, a), (h, b)), np.zeros(3)))
                    for kx in ((g, a), (h, b)):
                        marginal.setdefault(kx, {self.index[kx]: -1.0})[len(columns) - 1] = 1.0
            eq_rows += marginal.values()
        column = {k: i for i, k in enumerate(columns)}
        # a combine group the start does not pay for: z >= each choice that opens it, at its
        # latency (paid once however many open it); one it pays for: z <= the sum of the
        # choices that close it, at minus its latency (saved once, by any of them)
        self.at_least: list[dict[int, float]] = []
        for k in sorted(latency, key=repr):
            columns.append(k)
            z, by = len(columns) - 1, [column[c] for c, f in flips.items() if k in f]
            if k in fixed:  # sum(closing choices) - z >= 0
                coef.append(np.array([-latency[k], 0.0, 0.0]))
                self.at_least.append({z: -1.0, **dict.fromkeys(by, 1.0)})
            else:  # z - x >= 0 for each opening choice x
                coef.append(np.array([latency[k], 0.0, 0.0]))
                self.at_least += [{z: 1.0, c: -1.0} for c in by]
        self.flips = flips
        self.n_int, self.columns = len(self.index), columns
        self.coef = np.array(coef).reshape(-1, 3)
        self.eq_rows = eq_rows
        self.cuts: list[dict[int, float]] = []
        self.cut_hi: list[float] = []

    def value(self, chosen: dict[int, Option]) -> float:
        """The step time the model gives the combination ``chosen`` (group -> option)."""
        picked = {(g, chosen.get(g, ())) for g in self.groups}
        x = np.zeros(len(self.columns))
        for i, column in enumerate(self.columns):
            if column in picked or (isinstance(column[0], tuple) and set(column) <= picked):
                x[i] = 1  # an option, or a pair of options, that is chosen
        flipped = set().union(*(f for k, f in self.flips.items() if k in picked or set(k) <= picked))
        for i, column in enumerate(self.columns[len(self.index):], len(self.index)):
            if not isinstance(column[0], tuple):
                x[i] = column in flipped  # a combine group: its latency once if any choice opens (closes) it
        return self.base[0] + float(self.coef[:, 0] @ x)

    def solve_once(self, incumbent: Score, time_limit_s: float, consider) -> int | None:
        """One integer program: 1 when no combination can beat ``incumbent`` by the model (this
        start is proved), 0 when the solver stopped at its time limit, None to go on (the
        solution was evaluated and, unless it was better, cut off)."""
        from scipy.optimize import LinearConstraint, milp
        from scipy.sparse import csr_array

        if not self.groups:
            return 1
        t, m, w = self.base
        rows, lo, hi = list(self.eq_rows), [0.0] * len(self.eq_rows), [0.0] * len(self.eq_rows)
        lo[:len(self.groups)] = hi[:len(self.groups)] = [1.0] * len(self.groups)
        dense = []
        limits = [b for b in (self.budget, self.ceiling and self.ceiling.peak_bytes) if b is not None]
        if limits:
            dense.append((self.coef[:, 1], min(limits) - m))
        if self.ceiling is not None:
            dense.append((self.coef[:, 2], self.ceiling.wire_bytes * (1 + 1e-9) + 1e-6 - w))
        if fits_ceiling(incumbent, self.ceiling):  # only combinations the model says are faster
            dense.append((self.coef[:, 0], incumbent.time_s * (1 - RESOLUTION) - t))
        rows += self.at_least + self.cuts
        lo += [0.0] * len(self.at_least) + [-np.inf] * len(self.cuts)
        hi += [np.inf] * len(self.at_least) + self.cut_hi
        n = len(self.coef)
        data, ri, ci = [], [], []
        for r, row in enumerate(rows):
            ri += [r] * len(row)
            ci += list(row)
            data += list(row.values())
        matrix = csr_array((data, (ri, ci)), shape=(len(rows), n))
        constraints = [LinearConstraint(matrix, lo, hi)]
        for row, bound in dense:
            scale = max(np.abs(row).max(), 1e-30)
            constraints.append(LinearConstraint(row[None, :] / scale, -np.inf, bound / scale))
        integrality = np.r_[np.ones(self.n_int), np.zeros(n - self.n_int)]
        unit = t if t > 0 else max(np.abs(self.coef[:, 0]).max(), 1e-30)  # objective in O(1) units
        result = milp(self.coef[:, 0] / unit, constraints=constraints, integrality=integrality, bounds=(0, 1),
                      options={"time_limit": time_limit_s})
        if result.status == 2:
            return 1  # infeasible: nothing left that the model says fits and is faster
        if result.x is None:
            return 0
        if fits_ceiling(incumbent, self.ceiling) and t + unit * result.fun >= incumbent.time_s * (1 - 2 * RESOLUTION):
            return 1  # only within the solver's tolerance of the cutoff: nothing faster
        chosen = [k for k, i in self.index.items() if result.x[i] > 0.5]
        consider(self.start + tuple(m for _, o in chosen for m in o))
        self.cuts.append({self.index[k]: 1.0 for k in chosen})  # no-good cut: never this combination again
        self.cut_hi.append(len(chosen) - 1)
        return None


def latencies(space: SearchSpace, score: Score) -> dict[tuple, float]:
    """Per combine group (collectives XLA merges into one, see :mod:`automap.cost.combine`): the
    latency the plan pays for it (once, unless the group outgrows the combine threshold).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost import Topology
    >>> from automap.shardings import ShardingState
    >>> from search.space import GroupAction
    >>> jaxpr = jax.make_jaxpr(lambda w, x: jnp.tanh(x @ w))(jnp.ones((8, 8)), jnp.ones((8, 8)))
    >>> prog = lower(jaxpr, ["w", "x"], ["y"])
    >>> space = SearchSpace(ShardingState.initial(prog, {"data": 2}), topology=Topology.preset("cpu-sim"))
    >>> split = space.apply(space.root, GroupAction(0, 0, "data"))  # w's contraction dim: y is all-reduced
    >>> latencies(space, space.score(split))  # (kind, axes, region, count, height): seconds
    {('all-reduce', ('data',), 0, 1, 0): 2e-05}
    """
    from automap.cost.collectives import collective_time

    out: dict[tuple, float] = {}
    for c in score.estimate.collectives:
        if c.combine_key is not None and not c.combined:
            t = collective_time(c.kind, 0, c.axes, space.root.axes, space.topology) * c.count
            out[c.combine_key] = out.get(c.combine_key, 0.0) + t
    return out


def fits_ceiling(score: Score, ceiling: Ceiling | None) -> bool:
    """Whether ``score`` fits the memory budget and ``ceiling`` (when there is one).

    >>> import types
    >>> score = types.SimpleNamespace(feasible=True, peak_bytes=10, estimate=types.SimpleNamespace(wire_bytes=80.0))
    >>> fits_ceiling(score, None), fits_ceiling(score, Ceiling(wire_bytes=60.0, peak_bytes=10))
    (True, False)
    """
    return Objective(ceiling=ceiling).fits(score)
