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
import dataclasses
import math
from typing import Iterable, Literal, Mapping, Sequence

from automap.ir.program import Op
from automap.rules.registry import DimFactors, FactorRule
from automap.shardings import Action, ShardingState, Spec

Axes = tuple[str, ...]
CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all"]


def split_dim(axes: Axes, dim: DimFactors, rule: FactorRule, sizes: dict[str, int]) -> dict[int, Axes]:
    """Assign a dim's axes (major to minor) to its factors (major to minor)."""
    out: dict[int, Axes] = {}
    i, remaining = 0, None
    for a in axes:
        while i < len(dim):
            remaining = rule.factors[dim[i]].size if remaining is None else remaining
            if remaining != 1:
                break
            i, remaining = i + 1, None
        if i >= len(dim) or remaining % sizes[a]:
            break
        out[dim[i]] = out.get(dim[i], ()) + (a,)
        remaining //= sizes[a]
    return out


def compose_dim(dim: DimFactors, fax: dict[int, Axes], rule: FactorRule, sizes: dict[str, int]) -> Axes:
    """The axes of a dim given its factors' axes; a minor factor counts only once the ones
    before it are fully sharded (otherwise the tiling is not a block tiling of the dim)."""
    axes: Axes = ()
    for f in dim:
        got = fax.get(f, ())
        axes += got
        if math.prod(sizes[a] for a in got) != rule.factors[f].size:
            break
    return axes


def solve_factors(
    op: Op, state: ShardingState, specs: dict, prio: dict, *, operands_only: bool = False
) -> tuple[dict[int, Axes], dict[int, int]]:
    """The op's factor -> axes assignment from its linked values (earliest decision wins)."""
    rule, sizes = op.rule, state.axes
    linked = op.linked_inputs if operands_only else op.linked_inputs + op.linked_outputs
    dims_of = rule.operands + (() if operands_only else rule.results)
    cands: dict[int, list[tuple[int, int, Axes]]] = {}
    for pos, (vid, dims) in enumerate(zip(linked, dims_of, strict=True)):
        spec = specs.get(vid)
        if spec is None:
            continue
        for d, fs in enumerate(dims):
            if not spec[d] or not fs:
                continue
            p = prio.get((vid, d), 0)
            for f, axes in split_dim(spec[d], fs, rule, sizes).items():
                cands.setdefault(f, []).append((p, pos, axes))
    fax: dict[int, Axes] = {}
    fprio: dict[int, int] = {}
    used: dict[int, set[str]] = {}
    for f in sorted(cands, key=lambda f: min(cands[f])[:2]):
        factor = rule.factors[f]
        if factor.kind == "blocked":
            continue
        ordered = sorted(cands[f])
        choice = ordered[0][2]
        for _, _, axes in ordered[1:]:
            if len(axes) > len(choice) and axes[: len(choice)] == choice:
                choice = axes
        taken = used.setdefault(rule.group(f), set())
        kept: Axes = ()
        for a in choice:
            if a in taken or factor.size % (math.prod(sizes[b] for b in kept) * sizes[a]):
                break
            kept += (a,)
        if kept:
            fax[f], fprio[f] = kept, ordered[0][0]
            taken.update(kept)
    return fax, fprio


_SOLVED: dict[tuple, tuple] = {}


def _memo_key(op: Op, state: ShardingState, specs: Mapping, prio: Mapping) -> tuple:
    """What an op's factor solution depends on: its rule (shared by identical layers), the specs
    and priorities of its linked values, and the mesh (the rule object is kept in the entry, so
    its id is not reused while the entry lives)."""
    linked = op.linked_inputs + op.linked_outputs
    spec_key = tuple(specs.get(v) for v in linked)
    prio_key = tuple(
        prio.get((v, d)) for v, sp in zip(linked, spec_key) if sp is not None for d, ax in enumerate(sp) if ax
    )
    return id(op.rule), spec_key, prio_key, tuple(state.axes.items())


def _solved(op: Op, state: ShardingState, specs: dict, prio: dict) -> tuple[dict[int, Axes], dict[int, int]]:
    """:func:`solve_factors`, memoised on the op's rule and its linked values' specs and
    priorities (identical layers and repeated propagations hit the cache)."""
    key = _memo_key(op, state, specs, prio)
    got = _SOLVED.get(key)
    if got is None or got[2] is not op.rule:
        if len(_SOLVED) > 200_000:
            _SOLVED.clear()
        fax, fprio = solve_factors(op, state, specs, prio)
        got = _SOLVED[key] = (fax, fprio, op.rule)
    return got[0], got[1]


def _project(op: Op, state: ShardingState, specs: dict, prio: dict, frozen: frozenset) -> list[int]:
    """Push the op's solved factors onto its linked values; returns the values that changed."""
    fax, fprio = _solved(op, state, specs, prio)
    if not fax:
        return []
    changed = []
    rule, sizes = op.rule, state.axes
    for vid, dims in zip(op.linked_inputs + op.linked_outputs, rule.operands + rule.results, strict=True):
        if vid in frozen or not dims:
            continue
        spec = specs.get(vid)
        new = list(spec) if spec is not None else [() for _ in dims]
        touched = False
        for d, fs in enumerate(dims):
            if not fs:
                continue
            proposal = compose_dim(fs, fax, rule, sizes)
            current = new[d]
            if len(proposal) <= len(current) or proposal[: len(current)] != current:
                continue
            others = {a for e, axes in enumerate(new) if e != d for a in axes}
            extra: Axes = ()
            for a in proposal[len(current) :]:
                if a in others:
                    break
                extra += (a,)
            if not extra:
                continue
            new[d] = current + extra
            prio[(vid, d)] = min(fprio[f] for f in fs if f in fax)
            touched = True
        if touched:
            specs[vid] = tuple(new)
            changed.append(vid)
    return changed


def propagate(state: ShardingState, seeds: Iterable[int]) -> ShardingState:
    """Propagate from the values in ``seeds`` to a fixpoint."""
    program = state.program
    specs, prio = dict(state.specs), dict(state.priority)
    users = program.users
    queue: collections.deque[Op] = collections.deque()
    queued: set[int] = set()

    def push(vid: int) -> None:
        for op in users.get(vid, ()):
            if op.id not in queued:
                queued.add(op.id)
                queue.append(op)

    for vid in seeds:
        push(vid)
    budget = 64 * (len(program.all_ops) + 1)
    while queue and budget:
        budget -= 1
        op = queue.popleft()
        queued.discard(op.id)
        for vid in _project(op, state, specs, prio, state.frozen):
            push(vid)
    return state.replace(specs=specs, priority=prio)


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
    for action in actions:
        state.check_action(action)
        spec = list(state.spec(action.value)) if action.value not in specs else list(specs[action.value])
        spec[action.dim] = spec[action.dim] + (action.axis,)
        specs[action.value] = tuple(spec)
        prio[(action.value, action.dim)] = p
        state = state.replace(specs=specs)
    labels = dict(state.labels)
    labels[p] = label or f"decision {p}"
    state = state.replace(
        specs=specs, priority=prio, frozen=state.frozen | frozenset(freeze), next_priority=p + 1, labels=labels
    )
    return propagate(state, [a.value for a in actions])


# ---------------------------------------------------------------------------------------------
# what the assignment costs: resharding points


@dataclasses.dataclass(frozen=True)
class Reshard:
    """A collective implied by the assignment at one op (bytes are per device, per execution)."""

    op: int
    value: int
    kind: CollectiveKind
    axes: Axes
    bytes: int
    count: int  # how many times it runs (trip counts of enclosing loops)
    where: Literal["operand", "result"]
    reused: bool = False  # the same gather happened earlier in the same region: XLA reuses it (CSE)


def _per_device(nbytes: int, spec: Sequence[Axes], sizes: dict[str, int]) -> int:
    return nbytes // math.prod(sizes[a] for axes in spec for a in axes)


def _diff(actual: Spec, wanted: Spec) -> tuple[Axes, Axes]:
    """(axes to gather, axes to move between dims) to turn ``actual`` into ``wanted``."""
    gather, move = [], []
    for d, axes in enumerate(actual):
        for a in axes:
            if a in wanted[d]:
                continue
            (move if any(a in w for w in wanted) else gather).append(a)
    return tuple(gather), tuple(move)


def execution_factors(op: Op, state: ShardingState) -> dict[int, Axes]:
    """How the op runs: its factor -> axes, agreed by its operands and results (earliest decision
    wins). Operands and results that disagree with it are resharded before or after. A factor
    whose tiling no result can express (the minor factor of a merged dim) is not run sharded."""
    return _analysis(op, state)[0]


_CACHE: dict[tuple, tuple] = {}


def _analysis(op: Op, state: ShardingState) -> tuple[dict[int, Axes], tuple]:
    """(factor axes, reshard templates) of one op, memoised on the op's rule and the specs and
    priorities of its linked values: identical layers and revisited states hit the cache."""
    specs, prio = state.specs, state.priority
    key = _memo_key(op, state, specs, prio)
    got = _CACHE.get(key)
    if got is None or got[2] is not op.rule:
        if len(_CACHE) > 200_000:
            _CACHE.clear()
        fax = _expressible(op, solve_factors(op, state, specs, prio)[0], state.axes)
        got = _CACHE[key] = (fax, _templates(op, state, fax), op.rule)
    return got[0], got[1]


def _expressible(op: Op, fax: dict[int, Axes], sizes: dict[str, int]) -> dict[int, Axes]:
    rule = op.rule
    out = dict(fax)
    for dims in rule.results:
        for fs in dims:
            if len(fs) < 2:
                continue
            shown = compose_dim(fs, out, rule, sizes)
            for f in fs:
                if f in out and not set(out[f]) <= set(shown):
                    del out[f]
    return out


def _templates(op: Op, state: ShardingState, fax: dict[int, Axes]) -> tuple:
    """The op's reshards as (linked position, kind, axes, bytes, where)."""
    program, sizes, rule = state.program, state.axes, op.rule
    out = []
    n_in = len(op.linked_inputs)
    for pos, (vid, dims) in enumerate(zip(op.linked_inputs, rule.operands, strict=True)):
        if not dims:
            continue
        actual = state.spec(vid)
        wanted = tuple(compose_dim(fs, fax, rule, sizes) if fs else () for fs in dims)
        gather, move = _diff(actual, wanted)
        nbytes = program.values[vid].nbytes
        if gather:
            after = tuple(tuple(a for a in axes if a not in gather) for axes in actual)
            out.append((pos, "all-gather", gather, _per_device(nbytes, after, sizes), "operand"))
        if move:
            out.append((pos, "all-to-all", move, _per_device(nbytes, actual, sizes), "operand"))
    partial = tuple(a for f in rule.reduction_factors for a in fax.get(f, ()))
    for pos, (vid, dims) in enumerate(zip(op.linked_outputs, rule.results, strict=True)):
        if not dims and not partial:
            continue
        actual = state.spec(vid)
        implied = tuple(compose_dim(fs, fax, rule, sizes) if fs else () for fs in dims)
        nbytes = program.values[vid].nbytes
        in_actual = {a for axes in actual for a in axes}
        scatter = tuple(a for a in partial if a in in_actual and not any(a in i for i in implied))
        reduce = tuple(a for a in partial if a not in scatter)
        here = n_in + pos
        if scatter:
            out.append((here, "reduce-scatter", scatter, _per_device(nbytes, implied, sizes), "result"))
        if reduce:
            out.append((here, "all-reduce", reduce, _per_device(nbytes, implied, sizes), "result"))
        gather, move = _diff(implied, actual)
        if gather:
            out.append((here, "all-gather", gather, _per_device(nbytes, actual, sizes), "result"))
        if move:
            out.append((here, "all-to-all", move, _per_device(nbytes, implied, sizes), "result"))
    return tuple(out)


def reshards(state: ShardingState) -> list[Reshard]:
    """Every collective the assignment implies, op by op (the cost model prices these). A gather
    of the same value over the same axes in the same region is marked ``reused`` after its first
    occurrence: XLA computes it once (CSE)."""
    return analyse(state)[1]


def analyse(state: ShardingState) -> tuple[list[tuple[Op, int, dict[int, Axes]]], list[Reshard]]:
    """Every op with its trip multiplier and execution factors, and every reshard, in one pass."""
    program = state.program
    ops: list[tuple[Op, int, dict[int, Axes]]] = []
    out: list[Reshard] = []
    gathered: set[tuple] = set()
    for op, mult in program.walk():
        fax, templates = _analysis(op, state)
        ops.append((op, mult, fax))
        if not templates:
            continue
        region = program.values[op.outputs[0]].region if op.outputs else 0
        linked = op.linked_inputs + op.linked_outputs
        for pos, kind, axes, nbytes, where in templates:
            vid = linked[pos]
            reused = False
            if kind == "all-gather" and where == "operand":
                key = (vid, axes, region)
                reused = key in gathered
                gathered.add(key)
            out.append(Reshard(op.id, vid, kind, axes, nbytes, mult, where, reused))  # type: ignore[arg-type]
    return ops, out
