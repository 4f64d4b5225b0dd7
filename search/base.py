"""The searcher protocol and its result."""
from __future__ import annotations

import dataclasses
from typing import Protocol

from automap.shardings import ShardingState
from search.space import Move, Score, SearchSpace


@dataclasses.dataclass(frozen=True)
class SearchStats:
    episodes: int
    states_evaluated: int
    wall_time_s: float
    eval_time_s: float
    curve: tuple[float, ...] = ()  # best reward after each episode (convergence)


@dataclasses.dataclass(frozen=True, eq=False)
class SearchResult:
    """The best state found, its score, the actions that lead to it from the root, statistics."""

    state: ShardingState
    score: Score
    actions: tuple[Move, ...]
    stats: SearchStats
    searcher: str
    notes: tuple[str, ...] = ()  # what the searcher wants the report to say (e.g. the ceiling it held to)
    # the final candidates besides the answer, for XLA to arbitrate (automap.arbiter.final_choice):
    # (label, state, score), e.g. the expert ceiling plan and the next best plan
    alternatives: tuple[tuple[str, ShardingState, Score], ...] = ()

    def describe(self, space: SearchSpace) -> list[str]:
        return [space.describe(a) for a in self.actions]


class Searcher(Protocol):
    name: str

    def search(self, space: SearchSpace) -> SearchResult: ...


def better(a: Score, b: Score | None) -> bool:
    """Feasible beats infeasible; then the higher reward."""
    if b is None:
        return True
    return (a.feasible, a.reward) > (b.feasible, b.reward)
