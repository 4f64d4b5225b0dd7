"""An exact solver on small search spaces: integer programs over one option per decision group.

Each decision group chooses one option: stay as it is, one of its legal actions (tile one dim on
one mesh axis) or, on a mesh of several axes, one action on each of two axes. With tactics, the
problem splits by where a plan starts: the plan before the search, or one of the compositions of
the tactic macros (any tactic on any mesh axis, in any order: :func:`search.compose.compositions`)
that :class:`search.MCTS` seeds its tree with. Each start is one integer program over the options
legal there, so that group actions refine it.

Groups that propagation ties together (sharding a batch's tokens shards its targets) are one
decision there, whose options are the distinct plans of their joint choices: priced as two, each
interaction with the tie would be counted twice. Around its start, the cost model is evaluated
for every single option and every pair of options of two groups. The step time (and the peak
memory and bytes sent, for the budget and a ceiling) of a combination is then ``start + sum of single effects + sum of pairwise interactions``, with
one correction the cost model makes plain: collectives that XLA combines (one kind, the same
axes, the same place in the program, see :mod:`automap.cost.combine`) pay one latency between
them. So the latencies are taken out of the effects and priced per combine group: a group the
start does not pay for costs its latency once if any choice opens it, and one it pays for saves
its latency once if any choice closes it. Without that, sharding seven parameters over a second
axis would be priced as seven latencies less 21 pairwise corrections.

The pair products are linearised on the local polytope: for two groups that interact, a
continuous ``y[a, b]`` per pair of their options, whose sum over ``b`` equals ``x[a]`` and over
``a`` equals ``x[b]``; only the options ``x`` are integer. The program (scipy's ``milp``, HiGHS)
looks for a combination that the model says is faster than the best real plan so far, under the
budget (and the ceiling). Each one found is evaluated with the real cost model, kept if better
and cut off (a no-good cut) if not, and the program solved again until none is left: the start is
then proved. Starts are taken fastest first, so most end at their first solve. The result is
never worse than any combination evaluated exactly (every start, single option and pair).
``max_evaluations`` bounds the size (the start, single options and pairs the models evaluate, counted
once tied groups are merged): larger spaces raise :class:`TooLarge`.

:func:`refine` runs the same model around one plan, with single actions: :class:`search.MCTS`
ends with it.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Sequence

import numpy as np

from automap.shardings import ShardingError, ShardingState
from search.base import SearchResult, SearchStats, check_fields
from search.ceiling import Ceiling
from search.compose import compositions
from search.greedy import replay
from search.objective import Objective
from search.overlay import Replayer
from search.space import GroupAction, Move, Score, SearchSpace

MERGE_FIRST = 2  # a space is sized after its tied groups merge only when within this factor of the limit before
_RESOLUTION = 1e-6  # plans faster by less than this fraction count as no faster
OPTIMAL = "optimal under the pairwise cost model"  # the note of a result the solver proved


class TooLarge(ValueError):
    """The space needs more cost-model evaluations than the exact solver is allowed."""


Option = tuple  # the moves one choice makes: () leaves the group as it is
Plan = tuple  # (state, score, moves from the root)


def starts(space: SearchSpace) -> list[tuple[Move, ...]]:
    """Where a plan may start: the root (no moves), then, with tactics (a space with a context),
    each composition of the tactic macros that :class:`search.MCTS` seeds its tree with
    (:func:`search.compose.compositions`). Example (with :func:`combinations`): at the end of
    :func:`search.compose.tactic_compositions`'s."""
    return [()] + [p.moves for p in (compositions(space) if space.macros else [])]


def options(space: SearchSpace, state: ShardingState, two_axes: bool = True, tie: bool = True) -> list[list[Option]]:
    """Per decision group: () (leave it), each of its legal actions in ``state`` and, with
    ``two_axes`` on a mesh of several axes, each legal action followed by one on another axis
    (a parameter sharded over two axes, as FSDP over the whole mesh does). With ``tie``, groups
    that propagation ties together are one (:func:`_merge_tied`)."""
    legal = [a for a in space.legal(state) if isinstance(a, GroupAction)]
    out: list[list[Option]] = [[()] + [(a,) for a in legal if a.group == g] for g in range(len(space.groups))]
    for g, opts in enumerate(out if two_axes else ()):
        firsts = [(a, space.apply(state, a)) for (a,) in opts[1:]]
        seen = {after.key() for _, after in firsts}
        for a, after in firsts:
            for b in space.legal(after):
                if isinstance(b, GroupAction) and b.group == g and b.axis != a.axis:
                    key = space.apply(after, b).key()
                    if key not in seen:  # (b, a) makes the same plan as (a, b): one option
                        seen.add(key)
                        opts.append((a, b))
    return _merge_tied(space, state, out) if tie else out


def _merge_tied(space: SearchSpace, state: ShardingState, out: list[list[Option]],
                plan_of: Callable[[Option], ShardingState] | None = None) -> list[list[Option]]:
    """Groups that propagation ties together (an option of one makes the same plan as an option
    of the other, as a batch's tokens and targets do) become one group, whose options are the
    distinct plans of their joint choices, when these are fewer than twice their options apart;
    the other group keeps only (). Priced apart, the pairwise model would count each interaction
    with the tie twice (once per tied group). ``plan_of``: the state an option makes from
    ``state`` (a replay that keeps what it ran, for the model to reuse), if not this one's own."""
    after: dict[Option, ShardingState] = {(): state}

    def own_plan(moves: Option) -> ShardingState:
        got = after.get(moves)
        if got is None:
            got = own_plan(moves[:-1])
            try:
                got = space.apply(got, moves[-1])
            except ShardingError:
                pass  # as a replay does: a move the earlier ones made illegal is skipped
            after[moves] = got
        return got

    plan = own_plan if plan_of is None else plan_of

    made: dict = {}  # plan -> the groups that have an option making it
    for g, opts in enumerate(out):
        for o in opts[1:]:
            made.setdefault(plan(o).key(), []).append(g)
    made.pop(state.key(), None)
    for g, h in sorted({(gs[0], h) for gs in made.values() for h in gs[1:] if h != gs[0]}):
        if len(out[g]) < 2 or len(out[h]) < 2:
            continue  # one of them merged already
        joint: dict = {}  # plan -> the first joint choice that makes it (() first)
        for o in (a + b for a in out[g] for b in out[h]):
            joint.setdefault(plan(o).key(), o)
        if len(joint) < 2 * (len(out[g]) + len(out[h])):  # one mostly determines the other
            out[g], out[h] = list(joint.values()), [()]
    return out


def distinct_starts(space: SearchSpace) -> list[tuple[tuple[Move, ...], ShardingState]]:
    """(moves, state) of every distinct start (a composition that leaves the plan as an earlier
    start did is dropped)."""
    seen, out = set(), []
    for start in starts(space):
        state, done = replay(space, start)
        if state.key() not in seen:
            seen.add(state.key())
            out.append((done, state))
    return out


def combinations(space: SearchSpace, tie: bool = True, two_axes: bool = True,
                 begun: list[tuple[tuple[Move, ...], ShardingState]] | None = None,
                 ) -> list[tuple[tuple[Move, ...], list[list[Option]]]]:
    """(start moves, options per group) for every distinct start (``begun``, if given, are
    :func:`distinct_starts`); ``tie`` and ``two_axes`` as in :func:`options`."""
    return [(done, options(space, state, two_axes=two_axes, tie=tie))
            for done, state in (distinct_starts(space) if begun is None else begun)]


def _too_large(needed: int, limit: int, at_least: bool = False) -> TooLarge:
    return TooLarge(f"the exact solver would need {'at least ' * at_least}{needed} cost evaluations "
                    f"(max_evaluations={limit}): "
                    "use search.MCTS, or fewer decision groups")


def _pairs_needed(opts: Sequence[Sequence[Option]]) -> int:
    sizes = [len(o) - 1 for o in opts if len(o) > 1]
    return sum(sizes) + sum(a * b for a, b in itertools.combinations(sizes, 2))


@dataclasses.dataclass(frozen=True)
class ILP:
    """The exact solver (for spaces up to ``max_evaluations`` cost-model evaluations).

    >>> import search
    >>> search.ILP().name
    'ilp'
    """

    max_evaluations: int = 4000
    max_rounds: int = 64  # integer programs solved in all, each cutting off a plan the real model rejects
    time_limit_s: float = 30.0  # for all the solves together: then the best plan found stands
    ceiling: Ceiling | None = None  # bytes sent and memory a plan may not exceed (as MCTS holds to)
    name: str = "ilp"

    def __post_init__(self) -> None:
        check_fields(self, {"max_evaluations": 1, "max_rounds": 1, "time_limit_s": 0.0})

    def search(self, space: SearchSpace) -> SearchResult:
        t0 = time.perf_counter()
        begun = distinct_starts(space)
        # one axis per option first: no plan is made for it, and it counts no more than two axes
        # do, so a space it already shows too large is never sized in full
        for two_axes in (False, True):
            problems = combinations(space, tie=False, two_axes=two_axes, begun=begun)
            needed = sum(1 + _pairs_needed(opts) for _, opts in problems)  # before ties are merged: at most that
            if needed > MERGE_FIRST * self.max_evaluations:  # too large even if merging halved it: no merge run
                raise _too_large(needed, self.max_evaluations, at_least=not two_axes)
        problems = [(start, _merge_tied(space, replay(space, start)[0], opts)) for start, opts in problems]
        needed = sum(1 + _pairs_needed(opts) for _, opts in problems)  # what the models below evaluate
        if needed > self.max_evaluations:
            raise _too_large(needed, self.max_evaluations)
        objective = Objective(tolerance=0.0, ceiling=self.ceiling)
        best = _Incumbent(space, (space.root, space.score(space.root), ()), objective)
        consider = best.consider
        start_time = {start: consider(start).time_s for start, _ in problems}
        # fastest start first (over the budget too: its options may shard it under), so that a
        # good plan is known early and the other starts end at their first solve
        fastest_first = sorted(problems, key=lambda p: start_time[p[0]])
        rounds, proved = 0, 0
        for start, opts in fastest_first:
            model = _Pairwise(space, start, opts, self.ceiling, consider)
            while (left := self.time_limit_s - (time.perf_counter() - t0)) > 0 and rounds < self.max_rounds:
                rounds += 1
                done = model.solve_once(best.plan[1], left, consider)
                if done is not None:
                    proved += done
                    break
        stats = SearchStats(rounds, space.evaluations, time.perf_counter() - t0, space.eval_time_s)
        note = OPTIMAL if proved == len(problems) else (
            f"not proved optimal: {proved} of {len(problems)} starts proved after {rounds} integer programs in "
            f"{stats.wall_time_s:.1f} s (max_rounds={self.max_rounds}, time_limit_s={self.time_limit_s})")
        state, score, moves = best.plan
        return SearchResult(state, score, moves, stats, self.name, (note,))


def refine(space: SearchSpace, plan: Plan, objective: Objective = Objective(tolerance=0.0), max_work: int = 10**6,
           max_rounds: int = 8, time_limit_s: float = 30.0) -> Plan | None:
    """The best plan around ``plan`` (state, score, moves from the root) by the pairwise model:
    each group may take one more action legal there, all of them decided together, exactly (a
    move no one-action-at-a-time climb makes when the actions only pay off together). At most
    ``max_work`` plans evaluated times ops per plan (deterministic: no clock decides whether it
    runs): when the pairs of every option cost more, each option is evaluated alone and only the
    best of them (by ``objective``) are paired, as many as the work allows (so the work does not
    grow with the mesh axes); None when even that costs too much. Example: at the end of
    :func:`search.greedy.sweep`'s.
    """
    opts = options(space, plan[0], two_axes=False, tie=False)
    evaluations = max_work // max(len(space.program.all_ops), 1)
    best = _Incumbent(space, plan, objective, start=plan[2])
    if 1 + _pairs_needed(opts) > evaluations:
        singles = [(g, o) for g, group in enumerate(opts) for o in group[1:]]
        if 1 + len(singles) > evaluations:
            return None
        alone = {k: best.consider(plan[2] + k[1], keep=True) for k in singles}
        kept: list[list[Option]] = [[()] for _ in opts]
        for g, o in sorted(singles, key=lambda k: objective.key(alone[k])):
            kept[g].append(o)
            if 1 + len(singles) + _pairs_needed(kept) > evaluations:
                kept[g].pop()
                break
        opts = kept
    opts = _merge_tied(space, plan[0], opts, _options_replayed(best.replayed, plan))
    t0 = time.perf_counter()
    model = _Pairwise(space, plan[2], opts, objective.ceiling, best.consider)
    for _ in range(max_rounds):
        left = time_limit_s - (time.perf_counter() - t0)
        if left <= 0 or model.solve_once(best.plan[1], left, best.consider) is not None:
            break
    return best.plan


def _options_replayed(replayed: Replayer, plan: Plan) -> Callable[[Option], ShardingState] | None:
    """The state an option makes from ``plan``'s, by ``replayed`` (which keeps it: the pairwise
    model prices the option from it after), when the replay of ``plan``'s moves makes ``plan``'s
    state exactly (then both make the same states); None otherwise."""
    base = replayed(plan[2], keep=True)[0]
    if base is not plan[0] and any(getattr(base, f) != getattr(plan[0], f) for f in _STATE_FIELDS):
        return None
    return lambda option: replayed(plan[2] + option, keep=True)[0]


_STATE_FIELDS = ("program", "axes", "specs", "priority", "frozen", "next_priority", "labels")


class _Incumbent:
    """The best plan met so far, by the objective."""

    def __init__(self, space: SearchSpace, plan: Plan, objective: Objective,
                 start: tuple[Move, ...] | None = None) -> None:
        self.plan, self.objective, self.replayed = plan, objective, Replayer(space, start)
        self.space = space

    def consider(self, moves: tuple[Move, ...], keep: bool = False) -> Score:
        """Score the plan ``moves`` make from the root; keep it if it is the best so far.
        ``keep``: remember the state made (a prefix of plans to come)."""
        state, done = self.replayed(moves, keep)
        got = self.space.score(state)
        if self.objective.better(got, self.plan[1]):
            self.plan = (state, got, done)
        return got


class _Pairwise:
    """The pairwise cost model around one start, as a mixed-integer program."""

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
        if _fits(incumbent, self.ceiling):  # only combinations the model says are faster
            dense.append((self.coef[:, 0], incumbent.time_s * (1 - _RESOLUTION) - t))
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
        if _fits(incumbent, self.ceiling) and t + unit * result.fun >= incumbent.time_s * (1 - 2 * _RESOLUTION):
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


def brute_force(space: SearchSpace, ceiling: Ceiling | None = None) -> tuple[float, tuple[Move, ...]]:
    """The best step time over every start and every combination of options there (for testing
    the solver); with the moves that make it."""
    best: tuple[float, tuple[Move, ...]] = (float("inf"), ())
    for start, opts in combinations(space, tie=False):  # every joint choice of tied groups too
        for choice in itertools.product(*opts):
            moves = start + tuple(m for o in choice for m in o)
            s = space.score(replay(space, moves)[0])
            if _fits(s, ceiling) and s.time_s < best[0]:
                best = (s.time_s, moves)
    return best


def _fits(score: Score, ceiling: Ceiling | None) -> bool:
    return Objective(ceiling=ceiling).fits(score)
