"""The searcher protocol and its result."""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, Mapping, Protocol

from automap.shardings import ShardingState
from search.space import DEFAULT_MACROS, Move, Score, SearchSpace, macro_names


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


def check_fields(searcher: Any, at_least: Mapping[str, float], optional: tuple[str, ...] = (),
                 flags: tuple[str, ...] = ()) -> None:
    """Raise naming the field if a searcher's number is not a number, below its bound or (for ints
    bounds) not whole; ``optional`` fields may be None; ``flags`` must be bools.

    >>> import search
    >>> search.MCTS(episodes=-5)
    Traceback (most recent call last):
    ...
    ValueError: MCTS(episodes=-5): episodes must be an integer >= 1; ...
    """
    cls = type(searcher).__name__

    def fail(field: str, value: Any, want: str) -> ValueError:
        return ValueError(f"{cls}({field}={value!r}): {field} must be {want}; pass e.g. "
                          f"{cls}({field}={getattr(type(searcher), field, None)!r}) (the default)")

    for field, low in at_least.items():
        value = getattr(searcher, field)
        if value is None and field in optional:
            continue
        whole = isinstance(low, int)
        want = f"{'an integer' if whole else 'a number'} >= {low}" + (" or None" if field in optional else "")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (whole and not isinstance(value, numbers.Integral)):
            raise TypeError(str(fail(field, value, want)))
        if math.isnan(value) or value < low:
            raise fail(field, value, want)
    for field in flags:
        if not isinstance(getattr(searcher, field), bool):
            raise TypeError(str(fail(field, getattr(searcher, field), "True or False")))


def check_macros(searcher: Any) -> None:
    """Check a searcher's ``macros`` (the tactic macros its search space offers, by name) and hold
    them as a tuple; raise naming the unknown ones.

    >>> import search
    >>> search.MCTS(macros=["data_parallel", "megatron"]).macros
    ('data_parallel', 'megatron')
    >>> search.MCTS(macros=("data_parallel", "zero"))
    Traceback (most recent call last):
    ...
    ValueError: MCTS(macros=('data_parallel', 'zero')): unknown macro 'zero'; the macros are data_parallel, ...
    """
    macros = searcher.macros
    if isinstance(macros, str) or not all(isinstance(m, str) for m in macros):
        raise TypeError(f"{type(searcher).__name__}(macros={macros!r}): macros must be a sequence of macro names, "
                        f"e.g. {DEFAULT_MACROS!r} (the default)")
    known = macro_names()
    for name in macros:
        if name not in known:
            raise ValueError(f"{type(searcher).__name__}(macros={tuple(macros)!r}): unknown macro {name!r}; the "
                             f"macros are {', '.join(known)}")
    object.__setattr__(searcher, "macros", tuple(macros))
