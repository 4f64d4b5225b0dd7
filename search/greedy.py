"""Greedy search: one-step lookahead, the fast baseline; and the local moves that polish a plan."""
from __future__ import annotations

import dataclasses
import time

from automap.shardings import ShardingError, ShardingState
from search.base import SearchResult, SearchStats, check_fields, check_macros
from search.objective import Objective
from search.space import DEFAULT_MACROS, GroupAction, Move, Score, SearchSpace

STRICT = Objective(tolerance=0.0)


def best_step(
    space: SearchSpace, state: ShardingState, score: Score, objective: Objective = STRICT
) -> tuple[Move, ShardingState, Score] | None:
    """The single legal action that improves on ``score`` most (by ``objective``), or None."""
    best = None
    for action in space.legal(state):
        child = space.apply(state, action)
        got = space.score(child)
        if objective.better(got, score) and (best is None or objective.better(got, best[2])):
            best = (action, child, got)
    return best


def replay(space: SearchSpace, actions: tuple[Move, ...]) -> tuple[ShardingState, tuple[Move, ...]]:
    """Apply ``actions`` in order from the root, skipping those that are no longer legal or change
    nothing; the state and the actions that took effect."""
    state, done = space.root, []
    for action in actions:
        try:
            nxt = space.apply(state, action)
        except ShardingError:
            continue
        if nxt.key() != state.key():
            state = nxt
            done.append(action)
    return state, tuple(done)


def sweep(
    space: SearchSpace, state: ShardingState, axis: str, objective: Objective = STRICT
) -> tuple[tuple[Move, ...], ShardingState, Score]:
    """Tile every decision group that can be on ``axis``, one group at a time (largest first),
    each with its best legal action there (by ``objective``: the fastest that fits), even when that is worse than leaving the group: the
    move across a plateau that one action at a time cannot cross (sharding each parameter over
    a second axis adds collectives whose latency is paid once for all of them, so one parameter
    alone costs more and all of them together less). The actions taken and the plan at the end.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost import Topology
    >>> from automap.shardings import ShardingState
    >>> prog = lower(jax.make_jaxpr(lambda w, x: w - (x @ w))(jnp.ones((8, 8)), jnp.ones((8, 8))), ["w", "x"], ["w"])
    >>> space = SearchSpace(ShardingState.initial(prog, {"data": 2}), topology=Topology.preset("cpu-sim"))
    >>> moves, state, score = sweep(space, space.root, "data")
    >>> [space.describe(a) for a in moves]  # every group, each with its fastest action on 'data'
    ["w dim 1 on 'data'", "x dim 0 on 'data'"]
    >>> from search.ilp import refine  # the exact step around a plan never makes it worse
    >>> refine(space, (state, score, moves))[1].time_s <= score.time_s
    True
    >>> refine(space, (state, score, moves), max_work=1) is None  # too costly for its budget: skipped
    True
    """
    done: list[Move] = []
    for g in range(len(space.groups)):
        options = [a for a in space.legal(state) if isinstance(a, GroupAction) and a.group == g and a.axis == axis]
        children = [(a, space.apply(state, a)) for a in options]
        scored = [(a, child, space.score(child)) for a, child in children if child.key() != state.key()]
        if not scored:
            continue
        pick = min(scored, key=lambda got: objective.key(got[2]))
        done.append(pick[0])
        state = pick[1]
    return tuple(done), state, space.score(state)


def best_preemption(
    space: SearchSpace, actions: tuple[Move, ...], score: Score, objective: Objective = STRICT
) -> tuple[tuple[Move, ...], ShardingState, Score] | None:
    """The best plan made by deciding one group first and then replaying ``actions`` (earlier
    decisions win, so this overrides what a later tactic chose for that group: the move that
    adding actions alone cannot make), or None when none improves on ``score``."""
    best = None
    for first in space.legal(space.root):
        if not isinstance(first, GroupAction) or first in actions:
            continue
        state, done = replay(space, (first,) + actions)
        got = space.score(state)
        if objective.better(got, score) and (best is None or objective.better(got, best[2])):
            best = (done, state, got)
    return best


@dataclasses.dataclass(frozen=True)
class Greedy:
    """Take the single action that improves the score most, until none does.

    >>> import search
    >>> search.Greedy().name
    'greedy'
    """

    max_steps: int = 32
    name: str = "greedy"
    macros: tuple[str, ...] = DEFAULT_MACROS  # the tactic macros its space offers (search.space.macro_names)

    def __post_init__(self) -> None:
        check_fields(self, {"max_steps": 0})
        check_macros(self)

    def search(self, space: SearchSpace) -> SearchResult:
        t0 = time.perf_counter()
        state, score, actions = space.root, space.score(space.root), ()
        curve = []
        for _ in range(self.max_steps):
            best = best_step(space, state, score)
            if best is None:
                break
            action, state, score = best
            actions += (action,)
            curve.append(score.reward)
        stats = SearchStats(len(actions), space.evaluations, time.perf_counter() - t0, space.eval_time_s, tuple(curve))
        return SearchResult(state, score, actions, stats, self.name)
