"""Greedy search: one-step lookahead, the fast baseline."""
from __future__ import annotations

import dataclasses
import time

from search.base import SearchResult, SearchStats, better
from automap.shardings import ShardingState
from search.space import Move, Score, SearchSpace


def best_step(space: SearchSpace, state: ShardingState, score: Score) -> tuple[Move, ShardingState, Score] | None:
    """The single legal action that improves on ``score`` most, or None."""
    best = None
    for action in space.legal(state):
        child = space.apply(state, action)
        got = space.score(child)
        if better(got, score) and (best is None or better(got, best[2])):
            best = (action, child, got)
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
