"""When no plan fits the memory budget: recompute repeated blocks on the fastest plans.

Recomputation (:mod:`automap.ir.recompute`) trades a block's forward FLOPs for its residuals'
memory. It is tried only when the search found nothing within the budget: on each of the fastest
plans the search scored (and its answer), blocks are added greedily, the most memory saved per
second of recomputation first, until the plan fits; the fitting plan the objective orders first
wins. The cost model prices each try (liveness for the memory, the clones' FLOPs for the time).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from automap.ir.recompute import recompute_state, repeated_blocks
from automap.report import human_bytes
from automap.shardings import ShardingState
from search.objective import Objective
from search.space import Score, SearchSpace


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """A plan made to fit by recomputing ``blocks``, and what it cost."""

    state: ShardingState
    score: Score
    blocks: tuple[str, ...]
    before: Score  # the plan without recomputation

    def note(self) -> str:
        return (
            f"recompute {len(self.blocks)} block(s) ({', '.join(self.blocks)}): estimated peak "
            f"{human_bytes(self.before.peak_bytes)} -> {human_bytes(self.score.peak_bytes)} per device, step "
            f"{self.before.time_s * 1e3:.3f} -> {self.score.time_s * 1e3:.3f} ms"
        )


def greedy_recompute(space: SearchSpace, state: ShardingState) -> Recomputed | None:
    """``state`` with the fewest blocks recomputed, added by memory saved per second of recompute
    (each block measured alone), that fits ``space``'s budget; None if even all of them do not."""
    before = space.score(state)
    blocks = repeated_blocks(state.program)
    gains = []
    for i, block in enumerate(blocks):
        score = space.rescore(recompute_state(state, [block]))
        saved, slower = before.peak_bytes - score.peak_bytes, max(score.time_s - before.time_s, 1e-15)
        if saved > 0:
            gains.append((-saved / slower, i, block))
    chosen: list[str] = []
    for _, _, block in sorted(gains):
        chosen.append(block)
        ordered = [b for b in blocks if b in chosen]  # recomputed in program order
        got = recompute_state(state, ordered)
        score = space.rescore(got)
        if score.feasible:
            return Recomputed(got, score, tuple(ordered), before)
    return None


def fit_by_recompute(space: SearchSpace, answer: ShardingState,
                     objective: Objective = Objective()) -> Recomputed | None:
    """The best plan (by ``objective``) among the fastest plans ``space`` scored and ``answer``,
    each made to fit by :func:`greedy_recompute`; None if none can be."""
    candidates: Sequence[ShardingState] = [answer] + space.fastest_states()
    found = [got for got in map(lambda s: greedy_recompute(space, s), candidates) if got is not None]
    return min(found, key=lambda r: objective.key(r.score), default=None)
