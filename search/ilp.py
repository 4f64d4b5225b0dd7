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
once tied groups are merged): larger spaces raise :class:`TooLarge`, sized from what is cheapest
first (the root's options on one axis each, then every start's, then two axes per option) so
that a space already too large there is refused before the rest is built.

:func:`refine` runs the same model around one plan, with single actions: :class:`search.MCTS`
ends with it.
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable, Sequence


from automap.shardings import ShardingError, ShardingState
from search.base import SearchResult, SearchStats, check_fields, check_macros
from search.ceiling import Ceiling
from search.compose import compositions
from search.greedy import replay
from search.objective import Objective
from search.overlay import Replayer
from search.pairwise_model import PairwiseModel, fits_ceiling, latencies
from search.space import DEFAULT_MACROS, GroupAction, Move, Score, SearchSpace

MERGE_FIRST = 2  # a space is sized after its tied groups merge only when within this factor of the limit before
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
    macros: tuple[str, ...] = DEFAULT_MACROS  # the tactic macros its space offers (search.space.macro_names)

    def __post_init__(self) -> None:
        check_fields(self, {"max_evaluations": 1, "max_rounds": 1, "time_limit_s": 0.0})
        check_macros(self)

    def search(self, space: SearchSpace) -> SearchResult:
        t0 = time.perf_counter()
        # the root (the first start) on one axis per option bounds the size from below: a space it
        # already shows too large is refused before the other starts (the compositions) are built
        first = 1 + _pairs_needed(options(space, space.root, two_axes=False, tie=False))
        if first > MERGE_FIRST * self.max_evaluations:
            raise _too_large(first, self.max_evaluations, at_least=True)
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
            model = PairwiseModel(space, start, opts, self.ceiling, consider)
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
    model = PairwiseModel(space, plan[2], opts, objective.ceiling, best.consider)
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


def brute_force(space: SearchSpace, ceiling: Ceiling | None = None) -> tuple[float, tuple[Move, ...]]:
    """The best step time over every start and every combination of options there (for testing
    the solver); with the moves that make it."""
    best: tuple[float, tuple[Move, ...]] = (float("inf"), ())
    for start, opts in combinations(space, tie=False):  # every joint choice of tied groups too
        for choice in itertools.product(*opts):
            moves = start + tuple(m for o in choice for m in o)
            s = space.score(replay(space, moves)[0])
            if fits_ceiling(s, ceiling) and s.time_s < best[0]:
                best = (s.time_s, moves)
    return best
