"""Actions and fixpoint propagation through factor rules, and the resharding they imply.

:func:`apply` tiles dims of values (a group of :class:`~automap.shardings.Action` s decided
together), then pushes the assignment through every op's factor rule, forwards and backwards,
until nothing changes. Propagation only fills dims that are still whole (or extends a dim whose
axes are a prefix of the proposal), so earlier decisions are never undone: where two decisions
disagree at an op, the earlier wins and :func:`reshards` reports the collective the later one
costs there.
"""
from __future__ import annotations

import collections
from typing import Iterable, Mapping, Sequence

from automap.analysis import CollectiveKind, Reshard, analyse, execution_factors, note_derived, reshards
from automap.factors import SOLVED, Axes, Solution, compose_dim, extend_spec, solution, solve_factors, split_dim
from automap.ir.program import Op
from automap.shardings import Action, ShardingState, check_action

__all__ = [  # the factor solving and the reshard analysis live in automap.factors / automap.analysis
    "CollectiveKind", "Reshard", "analyse", "apply", "compose_dim", "execution_factors", "propagate", "reshards",
    "solve_factors", "split_dim",
]


def _project(
    op: Op, sol: Solution, sizes: Mapping[str, int], specs: dict, prio: dict, frozen: frozenset
) -> list[int]:
    """Push the op's solved factors onto its linked values (the writes ``sol`` precomputed, each
    dim's priority the earliest of its factors' sources); returns the values that changed."""
    linked = op.linked
    if not op.links_distinct:  # a value linked twice sees the first link's write: replay in order
        return _project_in_order(op, sol.fax, sol.priorities(linked, prio), sizes, specs, prio, frozen)
    get = prio.get
    writes = [  # every priority is read before any is written
        (linked[pos], new, [(d, min([get((linked[p], e), 0) for p, e in src])) for d, src in dims])
        for pos, new, dims in sol.updates if linked[pos] not in frozen
    ]
    for vid, new, dims in writes:
        specs[vid] = new
        for d, p in dims:
            prio[(vid, d)] = p
    return [vid for vid, _, _ in writes]


def _project_in_order(
    op: Op, fax: dict[int, Axes], fprio: dict[int, int], sizes: Mapping[str, int], specs: dict, prio: dict,
    frozen: frozenset,
) -> list[int]:
    """Push the factor axes ``fax`` (each factor's priority in ``fprio``) onto the op's linked
    values one after the other, each seeing the writes before it."""
    out = []
    rule = op.rule
    for vid, dims in zip(op.linked, rule.operands + rule.results, strict=True):
        if vid in frozen or not dims:
            continue
        new, changed = extend_spec(specs.get(vid), dims, fax, rule, sizes)
        for d in changed:
            prio[(vid, d)] = min(fprio[f] for f in dims[d] if f in fax)
        if changed:
            specs[vid] = new
            out.append(vid)
    return out


def propagate(state: ShardingState, seeds: Iterable[int]) -> ShardingState:
    """Propagate from the values in ``seeds`` to a fixpoint."""
    specs, prio = dict(state.specs), dict(state.priority)
    changed = _fixpoint(state, specs, prio, seeds)
    out = state.replace(specs=specs, priority=prio)
    _derived(out, state, changed)
    return out


def _fixpoint(state: ShardingState, specs: dict, prio: dict, seeds: Iterable[int]) -> set[int]:
    """Propagate from ``seeds`` in ``specs`` and ``prio`` (updated in place) to a fixpoint, under
    the program, mesh and frozen values of ``state``; returns the values whose spec changed."""
    program = state.program
    users = program.users_of
    queue: collections.deque[Op] = collections.deque()
    queued: set[Op] = set()
    for vid in seeds:
        for op in users[vid]:
            if op not in queued:
                queued.add(op)
                queue.append(op)
    changed: set[int] = set()
    budget = 64 * (len(program.all_ops) + 1)
    sizes, mesh_key, frozen = state.axes, state.mesh_key, state.frozen
    known, specs_get = SOLVED.get, specs.get
    while queue and budget:
        budget -= 1
        op = queue.popleft()
        queued.discard(op)
        sol = known((id(op.rule), tuple(map(specs_get, op.linked)), mesh_key))  # solution()'s key
        if sol.__class__ is not Solution:  # not solved yet, or priority-sensitive
            sol = solution(op, sizes, mesh_key, specs, prio)
        if not sol.updates:
            continue
        for vid in _project(op, sol, sizes, specs, prio, frozen):
            changed.add(vid)
            for user in users[vid]:
                if user not in queued:
                    queued.add(user)
                    queue.append(user)
    return changed


def apply(
    state: ShardingState, actions: Sequence[Action], *, freeze: Iterable[int] = (), label: str = ""
) -> ShardingState:
    """Apply a group of actions decided together, then propagate.

    ``freeze`` names values whose specs are final after the actions (e.g. inputs given a
    complete spec by the user): propagation will not add axes to them.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 4)), jnp.ones((4, 2))), ["x", "w"], ["y"])
    >>> s = apply(ShardingState.initial(prog, {"data": 2}), [Action(prog.inputs[0], 0, "data")])
    >>> s.spec(prog.outputs[0])
    (('data',), ())
    """
    specs, prio = dict(state.specs), dict(state.priority)
    p = state.next_priority
    program, axes = state.program, state.axes
    for action in actions:
        spec = specs.get(action.value)
        check_action(program, axes, spec, action)
        if axes[action.axis] == 1:  # tiles nothing: XLA drops a size-1 axis from every sharding
            continue
        dims = list(spec) if spec is not None else [() for _ in program.values[action.value].shape]
        dims[action.dim] += (action.axis,)
        specs[action.value] = tuple(dims)
        prio[(action.value, action.dim)] = p
    labels = dict(state.labels)
    labels[p] = label or f"decision {p}"
    out = state.replace(
        specs=specs, priority=prio, frozen=state.frozen | frozenset(freeze), next_priority=p + 1, labels=labels
    )
    seeds = [a.value for a in actions]
    changed = _fixpoint(out, specs, prio, seeds)  # completes out's own specs and priorities
    _derived(out, state, changed.union(seeds))
    return out


def _derived(new: ShardingState, old: ShardingState, changed: set[int]) -> None:
    """``new`` differs from ``old`` only in the specs and priorities of ``changed``: derive its key
    and its cost analysis from ``old``'s where they are known."""
    new.inherit_key(old, changed)
    note_derived(new, old, changed)
