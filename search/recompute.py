"""When no plan fits the memory budget: recompute repeated blocks on the fastest plans (in a
model without any, segments of its forward: :func:`~automap.ir.recompute.recompute_units`);
and whether the model's own remat pays (:func:`without_user_remat`).

Recomputation (:mod:`automap.ir.recompute`) trades a block's forward FLOPs for its residuals'
memory. It is tried only when the search found nothing within the budget: on each of the fastest
plans the search scored (and its answer), blocks are added greedily, the most memory saved per
second of recomputation first, until the plan fits, in each of three orders (every block wholly;
selectively, the weight matmuls' results kept; the selective ways, then the whole ones); the
fitting plan the objective orders first wins. The cost model prices each try (liveness for the memory, the clones' FLOPs for the time);
where compiling is affordable, XLA's measure of the chosen plan decides whether more blocks must
be recomputed (:func:`fit_by_measure`: the estimate can miss XLA's temporaries); where no plan
fits by estimate even recomputing, XLA measures the search's final candidates recomputing
(:func:`fit_candidates_by_measure`).

The model's own ``jax.checkpoint``/``nn.remat`` is a decision too: after every search,
:func:`without_user_remat` prices the answer and the fastest plans without it
(:mod:`automap.ir.unremat`), as they are or made to fit by the same orders (selective
recomputation in place of the model's whole one), and :func:`search.planning.run_search` keeps
whichever plan :meth:`~search.objective.Objective.choose` orders first, the remat kept on a tie
(``keep_user_remat=True`` forbids the drop).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from automap.ir.recompute import (block_mode, pending_blocks, recompute_state, recompute_units, regathered,
                                  selective)
from automap.ir.unremat import drop_remat_state, has_user_remat
from automap.report import human_bytes
from automap.shardings import ShardingState
from search.compose import compositions
from search.objective import Objective
from search.space import Score, SearchSpace


@dataclasses.dataclass(frozen=True)
class Recomputed:
    """A plan made to fit by recomputing ``blocks`` (and dropping the model's own remat, when
    ``dropped``: :func:`without_user_remat`), and what it cost."""

    state: ShardingState
    score: Score
    blocks: tuple[str, ...]
    before: Score  # the plan without recomputation (with the model's remat, when dropped)
    dropped: int = 0  # the model's remat calls dropped

    def note(self) -> str:
        what = (f"drop the model's remat ({self.dropped} call(s))" if self.dropped else "") + (
            " and " if self.dropped and self.blocks else "") + (
            f"recompute {len(self.blocks)} block(s) ({', '.join(self.blocks)})" if self.blocks else "")
        return (
            f"{what}: estimated peak "
            f"{human_bytes(self.before.peak_bytes)} -> {human_bytes(self.score.peak_bytes)} per device, step "
            f"{self.before.time_s * 1e3:.3f} -> {self.score.time_s * 1e3:.3f} ms"
        )


def recompute_orders(space: SearchSpace, state: ShardingState) -> list[list[str]]:
    """Orders in which to recompute repeated blocks, each made of the ways (wholly, its
    parameters gathered again: :func:`~automap.ir.recompute.regathered` is the same program; or
    selectively: :func:`~automap.ir.recompute.selective`) whose use alone lowers ``state``'s
    peak, the most memory saved per second of recompute first: every block wholly; every block
    selectively (where that takes less time than wholly); the ladder of the selective ways, then
    the whole ones (a block recomputed selectively early on is recomputed wholly further down).
    Which order gives the best fitting plan depends on the budget: the objective decides
    (:func:`fits_by_recompute`)."""
    before = space.rescore(state)
    gains: dict[int, list] = {0: [], 1: []}  # 0: selective, 1: whole
    for i, block in enumerate(recompute_units(state.program)):
        whole_score = None
        for rung, name in ((1, block), (0, selective(block))):
            score = space.rescore(recompute_state(state, [name]))
            saved, slower = before.peak_bytes - score.peak_bytes, max(score.time_s - before.time_s, 1e-15)
            if rung == 1:
                whole_score = score
            elif score.time_s >= whole_score.time_s:
                continue  # selective recomputation is worth it only if it takes less time than whole
            if saved > 0:
                gains[rung].append((-saved / slower, i, name))
    whole, some = ([name for *_, name in sorted(gains[r])] for r in (1, 0))
    orders = [whole, some, some + whole]
    return [o for k, o in enumerate(orders) if o and o not in orders[:k]]


def greedy_recompute(space: SearchSpace, state: ShardingState, order: Sequence[str],
                     before: Score | None = None) -> Recomputed | None:
    """``state`` with the shortest prefix of ``order`` recomputed (each block in the last way the
    prefix names it) that fits ``space``'s budget; None if even all of them do not. ``before``:
    ``state``'s score, if the search did not make it (not scored into the search's tables)."""
    blocks = recompute_units(state.program)
    for k in range(1, len(order) + 1):
        way = {block_mode(name)[0]: name for name in order[:k]}
        chosen = [way[b] for b in blocks if b in way]  # recomputed in program order
        got = recompute_state(state, chosen)
        score = space.rescore(got)
        if score.feasible:
            return Recomputed(got, score, tuple(chosen), before or space.score(state))
    return None


UNREMAT_CANDIDATES = 4  # the answer and the fastest plans scored, tried without the model's remat


def without_user_remat(space: SearchSpace, answer: ShardingState,
                       objective: Objective = Objective()) -> list[Recomputed]:
    """The answer and the fastest plans ``space`` scored (:data:`UNREMAT_CANDIDATES` in all)
    without the model's own ``remat``/``checkpoint`` (:func:`~automap.ir.unremat.drop_remat`):
    each as it is when it fits the budget, else made to fit by :func:`greedy_recompute` in each
    order of :func:`recompute_orders` (the dropped answer's blocks: e.g. selective recomputation
    in place of the model's whole one); best first by ``objective``; empty if the program has no
    user remat or nothing fits. The caller holds them against the plan with the remat kept."""
    if not has_user_remat(answer.program):
        return []
    candidates: dict = {}
    for state in [answer] + space.fastest_states():
        if len(candidates) < UNREMAT_CANDIDATES:
            candidates.setdefault(state.key(), state)
    orders: list[list[str]] | None = None
    dropped_answer = drop_remat_state(answer)
    found = []
    for state in candidates.values():
        before = space.score(state)
        dropped = dropped_answer if state is answer else drop_remat_state(state)
        score = space.rescore(dropped)
        n = len(state.program.remat_calls)
        if score.feasible:
            found.append(Recomputed(dropped, score, (), before, n))
            continue
        if orders is None:
            orders = recompute_orders(space, dropped_answer)
        found.extend(dataclasses.replace(got, before=before, dropped=n)
                     for got in _fitted(space, dropped, orders, score))
    return sorted(found, key=lambda r: objective.key(r.score))


LEANEST = 3  # expert compositions holding the least memory, candidates besides the fastest plans


def fits_by_recompute(space: SearchSpace, answer: ShardingState,
                      objective: Objective = Objective()) -> list[Recomputed]:
    """The fastest plans ``space`` scored, the :data:`LEANEST` compositions holding the least
    memory (:func:`search.compose.compositions`) and ``answer``, each made to fit by
    :func:`greedy_recompute` in each order of the answer's blocks (:func:`recompute_orders`; the
    blocks are alike, whatever the layout), best first by ``objective``; empty if none can be."""
    orders = recompute_orders(space, answer)
    if not orders:
        return []
    leanest = sorted(compositions(space), key=lambda p: p.score.peak_bytes)[:LEANEST] if space.macros else []
    candidates: Sequence[ShardingState] = [answer] + space.fastest_states() + [p.state for p in leanest]
    found, seen = [], set()
    for got in (got for s in candidates for got in _fitted(space, s, orders)):
        if got.state.key() not in seen:
            seen.add(got.state.key())
            found.append(got)
    return sorted(found, key=lambda r: objective.key(r.score))


def _fitted(space: SearchSpace, state: ShardingState, orders: list[list[str]],
            before: Score | None = None) -> list[Recomputed]:
    """``state`` made to fit by :func:`greedy_recompute` in each of ``orders``; none tried past
    the first if that is every block wholly (the leanest) and fits nothing."""
    out = []
    for k, order in enumerate(orders):
        got = greedy_recompute(space, state, order, before)
        if got is None and k == 0 and all(block_mode(name)[1] is None for name in order):
            break  # nothing leaner to try: selective ways keep more
        if got is not None:
            out.append(got)
    return out


def fit_by_recompute(space: SearchSpace, answer: ShardingState,
                     objective: Objective = Objective()) -> Recomputed | None:
    """The best of :func:`fits_by_recompute`, or None if no plan can be made to fit."""
    return next(iter(fits_by_recompute(space, answer, objective)), None)


MEASURED_FALLBACKS = 3  # further recomputing plans XLA measures when the best one stays over the budget
MEASURED_WAYS = 3  # at each step, the ways to recompute one more block that XLA measures


def fit_by_measure(state: ShardingState, budget: int, measure_state: Callable[[ShardingState], Any],
                   topology: Any = None, donated: Sequence[int] = (),
                   fallbacks: Sequence[ShardingState] = (),
                   laid_out: Callable[[ShardingState], ShardingState] | None = None,
                   ) -> tuple[ShardingState, str, int | None]:
    """XLA has the last word on a recomputing plan: while the compiled program's memory per
    device (``measure_state``) is over ``budget``, recompute one more block: of the ways to
    (each block left, wholly, selectively or re-gathered), the :data:`MEASURED_WAYS` the cost model says
    leave the least memory are compiled, and the one XLA measures smallest is taken (the
    estimate can rank them otherwise than XLA: recomputing the last block, whose residuals the
    backward reads at once, adds the copies it reads and saves nothing); if the plan is still
    over with every block recomputed, the next of ``fallbacks`` (the other recomputing plans,
    best first; at most :data:`MEASURED_FALLBACKS`) gets the same treatment. Returns the first
    state XLA measures within the budget (else the one it measures smallest, of every step), a
    note of what XLA measured, and that measure (bytes per device). ``laid_out`` (a state -> the
    layout its program compiles to: :meth:`search.space.SearchSpace.rescore`'s) is what the cost
    model prices to rank the ways, as XLA compiles them; the state itself where not given."""
    from automap.cost import estimate

    def peak(s: ShardingState) -> int:
        return estimate(s if laid_out is None else laid_out(s), topology, donated=donated).peak_memory_bytes

    tried, lines = [], []
    for start in [state, *fallbacks[:MEASURED_FALLBACKS]]:
        got = measure_state(start).memory_per_device
        seen = [f"{human_bytes(got)}"]
        smallest = (got if got is not None else 0, start)
        while got is not None and got > budget:
            left = pending_blocks(start.program)
            if not left:
                break
            ways = {}
            for name in (n for b in left for n in (b, selective(b), regathered(b))):
                got_state = recompute_state(start, [name])
                if got_state is not start:
                    ways.setdefault(got_state.key(), got_state)
            if not ways:
                break
            tries = sorted(ways.values(), key=peak)[:MEASURED_WAYS]
            got, start = min(((measure_state(s).memory_per_device or 0, s) for s in tries), key=lambda t: t[0])
            seen.append(f"{human_bytes(got)} recomputing {start.program.recomputed[-1]} too")
            smallest = min(smallest, (got, start), key=lambda t: t[0])
        lines.append(", then ".join(seen))
        tried.append(smallest)
        if got is None or got <= budget:
            break
    got, kept = next(((g, s) for g, s in tried if g <= budget), min(tried, key=lambda t: t[0]))
    verdict = "within" if got <= budget else "still over"
    which = "" if len(tried) == 1 else f" (plan {[s for _, s in tried].index(kept) + 1} of {len(tried)} measured)"
    return kept, (f"recompute: XLA measured {'; another plan: '.join(lines)}: {verdict} the budget of "
                  f"{human_bytes(budget)}{which}"), got


def leanest(state: ShardingState) -> ShardingState:
    """``state`` with every block it does not recompute yet recomputed wholly, its parameters
    gathered again (:func:`~automap.ir.recompute.regathered`): as a rule the least memory
    recomputation leaves a layout (XLA's measure may rank another way lower: its temporaries
    are its own)."""
    return recompute_state(state, [regathered(b) for b in pending_blocks(state.program)])


FLOOR_SLACK = 0.1  # a layout recomputing every block this far over the budget is not made to fit block by block


def fit_candidates_by_measure(candidates: Sequence[ShardingState], budget: int,
                              measure_state: Callable[[ShardingState], Any], topology: Any = None,
                              donated: Sequence[int] = (),
                              laid_out: Callable[[ShardingState], ShardingState] | None = None,
                              ) -> tuple[ShardingState, str, int | None] | None:
    """Where no plan fits the budget by estimate, recomputing or not, and XLA measures every
    final candidate of the search over it: each candidate recomputing every block
    (:func:`leanest`) is measured, and :func:`fit_by_measure` makes those within
    :data:`FLOOR_SLACK` of the budget fit in the order of that measure, smallest first (what
    recomputation can take off a layout says which layouts may fit at all; from the plan without
    recomputation, XLA picking each block added and its way: held-out attention_sdpa under ZeRO-3,
    its first layer re-gathered fits, 238,192 B, every layer re-gathered does not, 252,720 B, 1.05x
    the budget). Returns its answer, or the leanest plan XLA measured smallest where that is
    smaller; None where no candidate has a block to recompute and its state in and out (XLA's
    arguments and outputs: no recomputation shrinks them) within the budget. ``laid_out``: as for
    :func:`fit_by_measure`.

    >>> fit_candidates_by_measure([], 1, None) is None
    True
    """
    def state_over(c: ShardingState) -> bool:
        m = getattr(measure_state(c), "memory", None)
        return m is not None and m.argument + m.output - m.alias > budget

    with_blocks = [c for c in candidates if pending_blocks(c.program) and not state_over(c)]
    if not with_blocks:
        return None
    floors = []  # (XLA's measure of the candidate recomputing every block, its rank, the candidate, that plan)
    for k, c in enumerate(with_blocks):
        lean = leanest(c)
        floors.append((measure_state(lean).memory_per_device or 0, k, c, lean))
    floors.sort(key=lambda t: t[:2])
    measured = ", ".join(human_bytes(g) for g, *_ in floors)
    starts = [c for g, _, c, _ in floors if g <= budget * (1 + FLOOR_SLACK)]
    state, note, got = (fit_by_measure(starts[0], budget, measure_state, topology, donated, starts[1:], laid_out)
                        if starts else (None, "none within 10% of the budget", None))
    if got is None or (got > budget and floors[0][0] < got):
        got, _, _, state = floors[0]
        note += f"; kept the first recomputing every block, {human_bytes(got)}"
    return state, f"recompute: the final candidates recomputing every block measured {measured} by XLA; {note}", got
