"""Solving an op's factor rule against the specs of its linked values, memoised.

:func:`solve_factors` assigns mesh axes to the factors of an op's rule from the specs of the
values it links (earliest decision wins where they disagree). Propagation and the cost model ask
for the same solutions again and again (identical layers share a rule, and a search revisits
specs), so :func:`solution` memoises them as :class:`Solution` s keyed on the rule, the linked
specs and the mesh. Priorities join the key only where they can matter: most ops see no
disagreement, and then the solution is the same for any priorities (see :func:`_order_free`).
"""
from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING, Mapping, Sequence

from automap.ir.program import Op
from automap.rules import traits_of
from automap.rules.registry import DimFactors, FactorRule

if TYPE_CHECKING:
    from automap.shardings import ShardingState

Axes = tuple[str, ...]
Spec = tuple[Axes, ...]
# factor -> [(linked position, dim, axes)]: what each sharded dim of a linked value proposes
Candidates = dict[int, list[tuple[int, int, Axes]]]


def split_dim(axes: Axes, dim: DimFactors, rule: FactorRule, sizes: Mapping[str, int],
              padded: frozenset[int] | None = None) -> dict[int, Axes]:
    """Assign a dim's axes (major to minor) to its factors (major to minor). A ``padded`` factor
    (by default :func:`padded_factors`) takes an axis that does not divide it, its last tile
    padded: only :mod:`automap.xla_layout` gives a dim such axes, as Shardy does."""
    padded = padded_factors(rule) if padded is None else padded
    out: dict[int, Axes] = {}
    i, remaining = 0, None
    for a in axes:
        while i < len(dim):
            remaining = rule.factors[dim[i]].size if remaining is None else remaining
            if remaining != 1:
                break
            i, remaining = i + 1, None
        if i >= len(dim) or (remaining % sizes[a] and dim[i] not in padded):
            break
        out[dim[i]] = out.get(dim[i], ()) + (a,)
        remaining = -(-remaining // sizes[a])
    return out


def _minor_most(f: int, dim: DimFactors, rule: FactorRule) -> bool:
    """Whether factor ``f`` of ``dim`` is its minor-most of more than one element."""
    return f in dim and all(rule.factors[g].size == 1 for g in dim[dim.index(f) + 1:])


@functools.lru_cache(maxsize=4096)
def padded_factors(rule: FactorRule, permutation: bool = False) -> frozenset[int]:
    """The factors (of more than one element) minor-most in every dim holding them: Shardy splits
    such a factor over an axis that does not divide it, its last tile padded
    (``compatiblePrefixNoConflictsWithinFactor``); a factor of a merged dim but its minor-most
    takes only axes that divide it. A permutation factor counts only with ``permutation``
    (:mod:`automap.xla_layout`'s, of the joined dim's size): automap's own is the pieces' common
    size, smaller than the dims holding it, which an axis dividing the dim need not divide.
    Blocked factors take no axes. In automap's own layouts every split divides its dim, and so
    each factor of a dim split whole by its factors (a padded factor has the dim's size): padding
    changes nothing there.

    >>> from automap.rules.registry import Factor, FactorRule
    >>> rule = FactorRule((Factor(4), Factor(70)), (((0, 1),),), (((0,), (1,)),))  # (280,) -> (4, 70)
    >>> sorted(padded_factors(rule))
    [1]
    """
    dims = [dim for value in rule.operands + rule.results for dim in value]
    kinds = ("parallel", "reduction", "permutation") if permutation else ("parallel", "reduction")
    return frozenset(f for f, factor in enumerate(rule.factors)
                     if factor.size > 1 and factor.kind in kinds and all(_minor_most(f, dim, rule) for dim in dims if f in dim))


def compose_dim(dim: DimFactors, fax: Mapping[int, Axes], rule: FactorRule, sizes: Mapping[str, int]) -> Axes:
    """The axes of a dim given its factors' axes; a minor factor counts only once the ones
    before it are fully sharded (otherwise the tiling is not a block tiling of the dim)."""
    axes: Axes = ()
    for f in dim:
        got = fax.get(f, ())
        axes += got
        if math.prod(sizes[a] for a in got) != rule.factors[f].size:
            break
    return axes



def compose_spec(dims: Sequence[DimFactors], fax: Mapping[int, Axes], rule: FactorRule,
                 sizes: Mapping[str, int]) -> Spec:
    """The spec a value takes whose dims have the factors ``dims`` (a rule's ``operands[i]`` or
    ``results[j]``), given the factors' axes ``fax``: :func:`compose_dim` per dim, ``()`` for a
    dim without factors.

    >>> from automap.rules.registry import Factor, FactorRule
    >>> x, w, y = ((0,), (1,)), ((1,), (2,)), ((0,), (2,))  # y = x @ w: factors 0 (rows), 1 (summed), 2 (columns)
    >>> rule = FactorRule((Factor(8), Factor(4, "reduction"), Factor(6)), (x, w), (y,))
    >>> compose_spec(rule.results[0], {0: ("data",), 1: ("model",)}, rule, {"data": 2, "model": 4})
    (('data',), ())
    """
    return tuple(compose_dim(fs, fax, rule, sizes) if fs else () for fs in dims)

def _candidates(rule: FactorRule, dims_of: Sequence, spec_list: Sequence, sizes: Mapping[str, int],
                padded: frozenset[int] | None = None) -> Candidates:
    cands: Candidates = {}
    for pos, (spec, dims) in enumerate(zip(spec_list, dims_of, strict=True)):
        if spec is None:
            continue
        for d, fs in enumerate(dims):
            if spec[d] and fs:
                for f, axes in split_dim(spec[d], fs, rule, sizes, padded).items():
                    cands.setdefault(f, []).append((pos, d, axes))
    return cands


def _solve(rule: FactorRule, linked: Sequence[int], cands: Candidates, prio: Mapping, sizes: Mapping[str, int],
           contraction: bool = False, padded: frozenset[int] | None = None):
    """The factor -> axes assignment and each factor's earliest priority (``solve_factors``).
    Factors are taken earliest decision first; on equal priority in linked order, except at a
    ``contraction``, where they are taken as XLA's propagation and dot partitioner take them
    (:func:`_contraction_rank`)."""
    ranked = {f: [(prio.get((linked[pos], d), 0), pos, axes) for pos, d, axes in got] for f, got in cands.items()}
    if contraction:
        order = sorted(ranked, key=lambda f: _contraction_rank(rule, ranked[f], rule.factors[f].kind))
    else:
        order = sorted(ranked, key=lambda f: min(ranked[f])[:2])
    if rule.leading:
        order = [f for f in order if f in rule.leading] + [f for f in order if f not in rule.leading]
    fax: dict[int, Axes] = {}
    fprio: dict[int, int] = {}
    used: dict[int, set[str]] = {}
    padded = padded_factors(rule) if padded is None else padded
    for f in order:
        factor = rule.factors[f]
        if factor.kind == "blocked":
            continue
        ordered = sorted(ranked[f])
        choice = ordered[0][2]
        for _, _, axes in ordered[1:]:
            if len(axes) > len(choice) and axes[: len(choice)] == choice:
                choice = axes
        taken = used.setdefault(rule.group(f), set())
        kept: Axes = ()
        for a in choice:
            if a in taken or (factor.size % (math.prod(sizes[b] for b in kept) * sizes[a]) and f not in padded):
                break
            kept += (a,)
        if kept:
            fax[f], fprio[f] = kept, ordered[0][0]
            taken.update(kept)
    return fax, fprio


def _contraction_rank(rule: FactorRule, proposals: list, kind: str) -> tuple:
    """A contraction's factor's rank (lower first) from its proposals (priority, linked position,
    axes): the earliest priority; then, among factors of that priority, the one more linked
    values propose (a weight gradient's operands agree on the batch where its result wants a
    feature split: the batch wins and the partial sum is reduced); then one an operand proposes
    before one only the result does; then one the result keeps
    before a contracted one (a weight split on its contracting dim cannot split the result: it
    is gathered); then the larger proposer's (an activation split on the batch meets a weight
    split on its output features over the same axis: the smaller activation is gathered). These
    are the choices XLA compiles (tests/automap/test_propagate.py, 8 CPU devices)."""
    first = min(proposals)[0]
    at = [pos for p, pos, _ in proposals if p == first]
    dims = rule.operands + rule.results
    volume = max(math.prod(rule.factors[g].size for dim in dims[pos] for g in dim) for pos in at)
    return first, -len(at), min(at) >= len(rule.operands), kind == "reduction", -volume, min(at)


def _is_contraction(op: Op) -> bool:
    return traits_of(op.primitive).contraction is not None


def solve_factors(
    op: Op, state: ShardingState, specs: Mapping, prio: Mapping, *, operands_only: bool = False
) -> tuple[dict[int, Axes], dict[int, int]]:
    """The op's factor -> axes assignment from its linked values (earliest decision wins), and
    the priority of the earliest decision behind each factor."""
    rule = op.rule
    linked = op.linked_inputs if operands_only else op.linked
    dims_of = rule.operands + (() if operands_only else rule.results)
    spec_list = [specs.get(v) for v in linked]
    padded = padded_factors(rule)
    if padded_factors(rule, permutation=True) != padded and _uneven(state, linked, spec_list):
        padded = padded_factors(rule, permutation=True)
    cands = _candidates(rule, dims_of, spec_list, state.axes, padded)
    return _solve(rule, linked, cands, prio, state.axes, _is_contraction(op), padded)


def _uneven(state: ShardingState, linked: Sequence[int], spec_list: Sequence) -> bool:
    """Whether a linked value has a dim its axes do not divide: only the layout XLA gives
    (:mod:`automap.xla_layout`) splits a dim padded, a concatenation's joined dim as Shardy's
    factor of the result's size; there the op's permutation factor (the pieces' common size)
    takes such axes too (:func:`padded_factors`), and the concatenation is priced as XLA moves it
    (:func:`automap.analysis._permutation_moves`), not gathered."""
    values = state.program.values
    return any(spec is not None and any(axes and values[v].shape[d] % math.prod(state.axes[a] for a in axes)
                                        for d, axes in enumerate(spec))
               for v, spec in zip(linked, spec_list))


def _order_free(rule: FactorRule, cands: Candidates) -> bool:
    """Whether :func:`_solve` gives the same axes for any priorities: every factor's proposals
    are a chain of prefixes (the longest wins in any order), and no two factors of a group
    propose a common axis (so none can take an axis another one needs)."""
    by_group: dict[int, set[str]] = {}
    for f, got in cands.items():
        if rule.factors[f].kind == "blocked":
            continue
        longest = max((axes for _, _, axes in got), key=len)
        if any(axes != longest[: len(axes)] for _, _, axes in got):
            return False
        seen = by_group.setdefault(rule.group(f), set())
        if not seen.isdisjoint(longest):
            return False
        seen.update(longest)
    return True


class Solution:
    """An op's factor solution for one assignment of its linked values' specs.

    ``fax``: factor -> axes. ``sources``: factor -> the (linked position, dim) pairs proposing
    it (a factor's priority is the earliest of theirs). ``updates``: what propagation writes, as
    (linked position, new spec, ((dim, the sources of its factors), ...)), computed as if the
    linked values were distinct. ``analysis``: the cost model's view, filled in by
    :mod:`automap.analysis`. The rule is kept so its id is not reused while the entry lives."""

    __slots__ = ("analysis", "fax", "rule", "sources", "updates")

    def __init__(self, rule: FactorRule, fax: dict[int, Axes], cands: Candidates, spec_list: Sequence,
                 sizes: Mapping[str, int]):
        self.rule, self.fax, self.analysis = rule, fax, None
        self.sources = {f: tuple((pos, d) for pos, d, _ in cands[f]) for f in fax}
        self.updates = _updates(rule, fax, self.sources, spec_list, sizes)

    def priorities(self, linked: Sequence[int], prio: Mapping) -> dict[int, int]:
        """factor -> the priority of the earliest decision proposing it."""
        return {f: min(prio.get((linked[pos], d), 0) for pos, d in src) for f, src in self.sources.items()}


def extend_spec(spec: Spec | None, dims: Sequence[DimFactors], fax: Mapping[int, Axes], rule: FactorRule,
                sizes: Mapping[str, int]) -> tuple[Spec, tuple[int, ...]]:
    """A linked value's spec after propagation pushes the op's factor axes onto it, and the dims
    that changed: a whole dim (or one whose axes are a prefix of the proposal) takes the axes its
    factors propose, up to the first axis another dim of the value already uses."""
    new = list(spec) if spec is not None else [() for _ in dims]
    changed = []
    for d, fs in enumerate(dims):
        if not fs:
            continue
        proposal = compose_dim(fs, fax, rule, sizes)
        current = new[d]
        if len(proposal) <= len(current) or proposal[: len(current)] != current:
            continue
        others = {a for e, axes in enumerate(new) if e != d for a in axes}
        extra: Axes = ()
        for a in proposal[len(current):]:
            if a in others:
                break
            extra += (a,)
        if extra:
            new[d] = current + extra
            changed.append(d)
    return tuple(new), tuple(changed)


def _updates(rule: FactorRule, fax: dict[int, Axes], sources: dict, spec_list: Sequence,
             sizes: Mapping[str, int]) -> tuple:
    """Propagation's writes (:func:`extend_spec` of each linked value), with the sources of the
    factors behind each changed dim."""
    if not fax:
        return ()
    out = []
    for pos, (spec, dims) in enumerate(zip(spec_list, rule.operands + rule.results, strict=True)):
        if not dims:
            continue
        new, changed = extend_spec(spec, dims, fax, rule, sizes)
        if changed:
            behind = tuple(
                (d, tuple(dict.fromkeys(src for f in dims[d] if f in fax for src in sources[f]))) for d in changed
            )
            out.append((pos, new, behind))
    return tuple(out)


class _ByPriority(dict):
    """A memo entry whose solution depends on priorities: priority key -> :class:`Solution`."""

    __slots__ = ("cands", "rule")


# (id(rule), linked specs, mesh key) -> the solution; read directly by propagation's inner loop
SOLVED: dict[tuple, Solution | _ByPriority] = {}
_LIMIT = 200_000


def solution(op: Op, sizes: Mapping[str, int], mesh_key: tuple, specs: Mapping, prio: Mapping) -> Solution:
    """:func:`solve_factors` as a memoised :class:`Solution`, keyed on the op's rule (shared by
    identical layers), its linked values' specs and the mesh (``mesh_key``), and on their
    priorities only where these can change the answer."""
    spec_list = tuple(map(specs.get, op.linked))
    key = (id(op.rule), spec_list, mesh_key)
    got = SOLVED.get(key)
    if got is None:
        if len(SOLVED) > _LIMIT:
            SOLVED.clear()
        rule = op.rule
        cands = _candidates(rule, rule.operands + rule.results, spec_list, sizes)
        if _order_free(rule, cands):
            got = Solution(rule, _solve(rule, op.linked, cands, prio, sizes, _is_contraction(op))[0], cands, spec_list,
                           sizes)
        else:
            got = _ByPriority()
            got.rule, got.cands = rule, cands
        SOLVED[key] = got
    if got.__class__ is Solution:
        return got
    prio_key = tuple(
        prio.get((v, d)) for v, sp in zip(op.linked, spec_list) if sp is not None for d, ax in enumerate(sp) if ax
    )
    sol = got.get(prio_key)
    if sol is None:
        if len(got) > 4096:
            got.clear()
        rule, cands = op.rule, got.cands
        sol = got[prio_key] = Solution(rule, _solve(rule, op.linked, cands, prio, sizes, _is_contraction(op))[0], cands,
                                       spec_list, sizes)
    return sol
