"""The search step of planning: fill what the tactics left open, under a memory budget."""
from __future__ import annotations

import dataclasses
from typing import Any

from automap.cost import Topology, default_topology, parse_bytes
from automap.report import human_bytes
from automap.shardings import ShardingState
from search.base import SearchResult
from search.space import DEFAULT_MACROS, SearchSpace


class MemoryBudgetError(ValueError):
    """No explored plan fits the per-device memory budget. ``result``: the search's answer and
    final candidates (:class:`~search.base.SearchResult`) where a search ran, for XLA to measure
    against the budget (the estimate may put over it a plan XLA's program fits)."""

    result: Any = None


def budget_bytes(memory_budget: int | str | None, topology: Topology) -> int:
    if memory_budget is None:
        return int(topology.device.memory_bytes)
    return parse_bytes(memory_budget)


def _largest_inputs(state: ShardingState) -> str:
    top = sorted(state.program.inputs, key=lambda v: -state.bytes_per_device(v))[:5]
    return ", ".join(f"{state.program.values[v].name} ({human_bytes(state.bytes_per_device(v))})" for v in top)


def check_budget(state: ShardingState, peak_bytes: int, memory_budget: int | str) -> None:
    """Raise :class:`MemoryBudgetError` if a plan made without a search (tactics only, or
    ``search=None``) needs more than the user's ``memory_budget`` per device."""
    budget = parse_bytes(memory_budget)
    if peak_bytes > budget:
        raise MemoryBudgetError(
            f"the plan needs an estimated {human_bytes(peak_bytes)} per device, over memory_budget="
            f"{memory_budget!r} ({human_bytes(budget)}); no search ran (search=None, or the tactics used every mesh "
            f"axis). Largest inputs per device: {_largest_inputs(state)}. Raise memory_budget, add tactics (fsdp, "
            "megatron) that shard these values, or let a search fill the plan (search='auto' with fewer tactics)"
        )


def run_search(
    searcher: Any, state: ShardingState, *, topology: Topology | None, memory_budget: int | str | None,
    donated: Any = (), data_inputs: Any = (), context: Any = None, keep_user_remat: bool = False,
    emitted_layout: Any = None,
) -> tuple[ShardingState, SearchResult, tuple[str, ...]]:
    """Search from ``state``; raise :class:`MemoryBudgetError` if nothing explored fits. Unless
    ``keep_user_remat``, the answer without the model's own remat (alone, or with blocks
    recomputed: :func:`search.recompute.without_user_remat`) replaces it when the objective
    orders it first. ``emitted_layout`` (state -> the layout its program compiles to) prices the
    final candidates (:meth:`search.space.SearchSpace.emitted_score`). The space offers the
    searcher's ``macros`` (all of them where it names none: a searcher of the user's own)."""
    topology = topology or default_topology()
    budget = budget_bytes(memory_budget, topology)
    space = SearchSpace(
        state, topology=topology, memory_budget=budget, donated=tuple(donated), data_inputs=tuple(data_inputs),
        context=context, emitted_layout=emitted_layout, macros=getattr(searcher, "macros", DEFAULT_MACROS),
    )
    result = searcher.search(space)
    recomputing: tuple[str, ...] = ()
    if not keep_user_remat:  # activation checkpointing is the search's decision: the model's own too
        result, recomputing = _user_remat_decided(space, result)
    if not result.score.feasible:  # trade FLOPs for memory: recompute blocks on the fastest plans
        from search.recompute import fits_by_recompute

        fits = fits_by_recompute(space, result.state)
        if fits:
            got = fits[0]
            others = tuple(("recomputing plan", r.state, r.score) for r in fits[1:])
            result = dataclasses.replace(result, state=got.state, score=got.score, alternatives=others)
            recomputing = (got.note(),)
    if not result.score.feasible:
        best = min(space._scores.values(), key=lambda s: s.peak_bytes)
        error = MemoryBudgetError(
            f"no plan found within the memory budget of {human_bytes(budget)} per device: the smallest "
            f"per-device peak explored was {human_bytes(best.peak_bytes)} ({result.stats.states_evaluated} "
            f"plans evaluated; recomputing repeated blocks, or segments of the forward, did not fit either). Largest inputs per device in the best plan: {_largest_inputs(result.state)}. Raise "
            "memory_budget, use a larger mesh, or add tactics (fsdp, megatron) that shard these values"
        )
        error.result = result
        raise error
    notes = (
        f"search {result.searcher}: {result.stats.episodes} episodes, {result.stats.states_evaluated} plans "
        f"evaluated in {result.stats.wall_time_s:.2f} s; estimated step {result.score.time_s * 1e3:.3f} ms, "
        f"peak {human_bytes(result.score.peak_bytes)}/device (budget {human_bytes(budget)})",
    ) + tuple(f"search: {d}" for d in result.describe(space)) + tuple(f"search: {n}" for n in result.notes + recomputing)
    return result.state, result, notes


def _user_remat_decided(space: SearchSpace, result: SearchResult) -> tuple[SearchResult, tuple[str, ...]]:
    """``result`` with the model's remat dropped (and blocks recomputed as the budget needs) if
    :meth:`~search.objective.Objective.choose` chooses that over the answer as it is (the
    faster beyond the tolerance; within it, the fewer bytes sent, then the less memory: the kept
    remat, listed first, wins a tie), and the note saying so."""
    from search.objective import Objective
    from search.recompute import without_user_remat
    from search.space import Plan

    options = without_user_remat(space, result.state)
    if not options:
        return result, ()
    kept = Plan(result.state, result.score, ())
    best = Objective().choose([kept] + [Plan(r.state, r.score, ()) for r in options])
    if best is kept:
        return result, (f"kept the model's remat ({len(result.state.program.remat_calls)} call(s)): the best "
                        f"plan without it, {options[0].note()}, is not better",)
    got = next(r for r in options if r.state is best.state)
    return dataclasses.replace(result, state=got.state, score=got.score), (got.note(),)
