"""Tactic compositions: the plans an expert builds from the tactic macros (data parallel, Megatron,
FSDP, expert parallelism where the program has experts, sequence parallelism right after a
Megatron), each placed on any mesh axis, in any order, one tactic over several axes included.

They are found by a beam search over the macro-actions (:func:`compositions`): from the root,
every macro on every axis it may take, the ``width`` best (by :class:`search.objective.Objective`)
kept and extended again, until no macro changes a plan. That costs ``width x macros x axes``
tactic applications per level, not one per ordering of the axes, and at most ``BEAM_BUDGET``
in all (the beam stops there: the same cost on any number of axes). The fastest fitting one sets
the expert ceiling (:func:`expert_plan`, :mod:`search.ceiling`) that the searched plan is held to.
"""
from __future__ import annotations

import itertools

from search.ceiling import Ceiling
from search.greedy import replay
from search.objective import Objective
from search.space import REFINES, Move, Plan, SearchSpace, TacticAction, used_axes

BEAM_WIDTH = 6  # on two axes: every single macro is extended, so every ordered pair is tried
DOMINANCE_TOLERANCE = 0.01  # relative: a plan 1% leaner in both bytes sent and memory dominates
BEAM_BUDGET = 80  # tactic applications in all (zoo GPT on two axes takes 59; three axes and the MoE are cut short)


def compositions(space: SearchSpace, width: int = BEAM_WIDTH) -> list[Plan]:
    """Every composition the beam met (distinct plans), best first by the objective without a
    ceiling; memoised per space and width. Example: at the end of :func:`tactic_compositions`'s."""
    memo = space.memo.setdefault("compositions", {})
    if width in memo:
        return memo[width]
    order = Objective(tolerance=0.0)
    seen = {space.root.key()}
    frontier, met, budget = [Plan(space.root, space.score(space.root), ())], [], BEAM_BUDGET
    while frontier:
        children, refined = [], []
        for plan in frontier:
            todo = [(plan, a) for a in space.legal(plan.state)
                    if isinstance(a, TacticAction) and a.tactic not in REFINES]
            while todo and budget > 0:
                base, action = todo.pop(0)
                budget -= 1
                state = space.apply(base.state, action)
                if state.key() in seen:
                    continue
                seen.add(state.key())
                child = Plan(state, space.score(state), base.moves + (action,))
                (refined if action.tactic in REFINES else children).append(child)
                # a macro that refines one this new plan holds on an axis (sequence parallelism:
                # megatron's regions) is tried on it right away, once, whichever order made the
                # plan (dp then megatron and megatron then dp are one state, met once); the plan
                # it makes is met but not extended (it would take a place in the beam from a plan
                # that differs more)
                if action.tactic in REFINES:
                    continue
                done = {(a.tactic, a.axis) for a in child.moves if isinstance(a, TacticAction)}
                todo[:0] = [(child, TacticAction(r, axis)) for r, of in REFINES.items() if r in space.macros
                            for t, axis in sorted(done) if t == of and (r, axis) not in done
                            and space.offered(r, axis, state)]
        children.sort(key=lambda p: order.key(p.score))  # stable: ties keep the legal order
        met += children + refined
        frontier = children[:width]
    memo[width] = sorted(met, key=lambda p: order.key(p.score))
    return memo[width]


def expert_plan(space: SearchSpace, width: int = BEAM_WIDTH) -> Plan | None:
    """The fastest plan that fits the budget among the compositions and the root (the plan before
    the search), or None without tactics or when none of them fits. (Dominance in bytes sent and
    memory is XLA's to judge, on the final candidates: :func:`automap.arbiter.final_choice`; held
    to the fastest undominated composition instead, the search lost up to 1.28x the best expert's
    step on the Megatron benchmark's two-node meshes.)"""
    plans = compositions(space, width) if space.macros else []
    if not plans:
        return None
    order = Objective(tolerance=0.0)
    root = Plan(space.root, space.score(space.root), ())
    fitting = [p for p in [root] + plans if p.score.feasible]
    if not fitting:
        return None
    return min(fitting, key=lambda p: order.key(p.score))


def undominated(plans: list[Plan], tolerance: float = DOMINANCE_TOLERANCE) -> list[Plan]:
    """The plans no other plan dominates: sends fewer bytes *and* holds less memory, each by more
    than ``tolerance`` (relative). The fastest of this front are the expert candidates XLA
    measures last (:func:`search.mcts._alternatives`), so that the answer it keeps is dominated by
    none of them by XLA's measure.

    >>> import types
    >>> def plan(name, wire, peak):
    ...     est = types.SimpleNamespace(wire_bytes=wire)
    ...     return Plan(name, types.SimpleNamespace(estimate=est, peak_bytes=peak), ())
    >>> [p.state for p in undominated([plan("dp", 50.0, 320), plan("tp", 38.0, 84), plan("none", 0.0, 900)])]
    ['tp', 'none']
    """
    def dominates(q: Plan, p: Plan) -> bool:
        slack = 1 - tolerance
        return (q.score.estimate.wire_bytes < p.score.estimate.wire_bytes * slack
                and q.score.peak_bytes < p.score.peak_bytes * slack)

    return [p for p in plans if not any(dominates(q, p) for q in plans if q is not p)]


def whole_mesh_fsdp(space: SearchSpace) -> Plan | None:
    """ZeRO-3 over every free mesh axis jointly (``fsdp(('data', 'model'))``: each leaf's one dim
    split over all of them, as an expert writes FSDP for the whole mesh), a plan no composition of
    the macros makes (``fsdp`` on a second axis splits a second dim); None without ``fsdp`` among
    the macros, with fewer than two free axes, or when it changes nothing. One of the final
    candidates XLA measures (:func:`search.mcts._alternatives`; memoised per space). Example: in
    :func:`tactic_compositions`' doctest.
    """
    if "whole_mesh_fsdp" not in space.memo:
        plan = None
        free = tuple(a for a in space.axes if a not in used_axes(space.root, space.axes))
        if "fsdp" in space.macros and len(free) > 1:
            action = TacticAction("fsdp", free)
            state = space.apply(space.root, action)
            if state.key() != space.root.key():
                plan = Plan(state, space.score(state), (action,))
        space.memo["whole_mesh_fsdp"] = plan
    return space.memo["whole_mesh_fsdp"]


def ceiling_of(space: SearchSpace, plan: Plan) -> Ceiling:
    source = " + ".join(space.describe(a) for a in plan.moves) or "the plan before the search"
    return Ceiling(plan.score.estimate.wire_bytes, plan.score.peak_bytes, source)


def expert_ceiling(space: SearchSpace, width: int = BEAM_WIDTH) -> Ceiling | None:
    """The ceiling :class:`search.MCTS` holds its answer to: the bytes sent and the memory of
    :func:`expert_plan` (None without it). Give it to ``search.ILP(ceiling=...)`` to solve the
    same problem exactly (example: at the end of :func:`tactic_compositions`'s)."""
    plan = expert_plan(space, width)
    return None if plan is None else ceiling_of(space, plan)


def tactic_compositions(space: SearchSpace, limit: int) -> list[tuple[Move, ...]]:
    """The compositions with one macro (or none) per free mesh axis (of those offered on it from
    the root: no expert parallelism without experts, no sequence parallelism alone), axes in mesh
    order, fewest tactics first, at most ``limit`` (``(macros + 1) ** axes`` in all: for benchmarks
    and tests that compare the search with every such expert plan).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.cost import Topology
    >>> from automap.shardings import ShardingState
    >>> from tactics import PlanContext
    >>> prog = lower(jax.make_jaxpr(lambda w, x: w - (x @ w))(jnp.ones((8, 8)), jnp.ones((8, 8))), ["w", "x"], ["w"])
    >>> axes = {"data": 2, "model": 2}
    >>> space = SearchSpace(ShardingState.initial(prog, axes), topology=Topology.preset("cpu-sim"),
    ...                     context=PlanContext(prog, axes, (prog.inputs[1],), (prog.inputs[0],)))
    >>> seeds = tactic_compositions(space, limit=100)
    >>> len(seeds), [f"{a.tactic}({a.axis})" for a in seeds[-1]]  # 3 x 3 pairs + 2 x 3 singles
    (15, ['fsdp(data)', 'fsdp(model)'])
    >>> len(compositions(space))  # distinct plans, in any order of the axes (the two like axes: one)
    2
    >>> joint = whole_mesh_fsdp(space)  # ZeRO-3 over both axes: the weight's dim 0 over ('data', 'model')
    >>> joint.moves, joint.state.spec(prog.inputs[0])
    ((TacticAction(tactic='fsdp', axis=('data', 'model')),), (('data', 'model'), ()))
    >>> expert_ceiling(space).source  # this tiny step is fastest unsharded: nothing may be sent
    'the plan before the search'
    >>> from search.ilp import combinations, starts  # the exact solver's starts: the root and each composition
    >>> len(starts(space)), len(combinations(space))
    (3, 3)
    """
    if not space.macros or not space.axes:
        return []
    options = [[()] + [(TacticAction(m, axis),) for m in space.macros if space.offered(m, axis, space.root)]
               for axis in space.axes]
    combos = [sum(c, ()) for c in itertools.product(*options)]
    return sorted((c for c in combos if c), key=len)[:limit]


def replayed(space: SearchSpace, moves: tuple[Move, ...]) -> Plan:
    """The plan ``moves`` make from the root (moves that are no longer legal are skipped)."""
    state, done = replay(space, moves)
    return Plan(state, space.score(state), done)
