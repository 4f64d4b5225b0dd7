"""What an assignment implies, op by op: how each op runs and the collectives around it.

An op runs with the factor axes its linked values agree on (:func:`execution_factors`);
operands and results laid out otherwise are resharded before or after it (:class:`Reshard`).
:func:`analyse` walks every op; the cost model prices what it finds. Where XLA's partitioner runs
an op otherwise than the factor solution says, the op's analysis follows XLA: contractions in
:mod:`automap.contraction_layouts`, gathers and scatter-adds in :mod:`automap.indexed_ops`.

Both are memoised twice over: per op, with the op's factor solution (identical layers and
revisited specs hit the cache), and per state: a state made by
:func:`~automap.propagate.apply` from an analysed state records which values it changed
(:func:`note_derived`), and its analysis redoes only the ops that link those values.
"""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterable, Literal, Sequence

from automap.factors import Axes, compose_dim, compose_spec, solution, solve_factors
from automap.contraction_layouts import CONTRACTIONS, as_xla_contracts, batch_groups_split_within
from automap.conv_halos import HALO_PRIMITIVES, halo_moves, summed_groups
from automap.gather_reuse import gathered_apart, grouped_on_the_sum
from automap.indexed_ops import INDEXED, indices_first, indices_moved_to_idle, made_whole
from automap.ir.program import Op, Program
from automap.loop_invariants import loop_invariants
from automap.merged_slices import sliced_further, sliced_once
from automap.mismatched_sums import reordered_sum
from automap.reshard_bytes import moved_bytes
from automap.rules import traits_of
from automap.shardings import ShardingState, Spec
from automap.split_moves import pieces_moved
from automap.tile_order import (chained_moves, disjoint_retile, displaced_axes, full_rematerialization, joined_axes,
                                tile_permute)
from automap.whole_gathers import grouped_partner

CollectiveKind = Literal["all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"]
Analysis = tuple[dict[int, Axes], tuple, int]  # (factor axes, reshard templates, pieces)


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
    group: int = 0  # devices per group where fewer than the axes hold (a subgroup of them); 0: all of them


def _per_device(nbytes: int, spec: Sequence[Axes], sizes: dict[str, int]) -> int:
    return nbytes // math.prod(sizes[a] for axes in spec for a in axes)


def _diff(actual: Spec, wanted: Spec) -> tuple[Axes, Axes]:
    """(axes to gather, axes to move between dims) to turn ``actual`` into ``wanted``. XLA moves
    an axis to another dim by an all-to-all only where no axis minor to it in its dim is
    gathered; one major to a gathered axis is gathered too (a [8, 4, 4, 32] array on ('data',
    'model') along dim 0 to 'data' along dim 3: all 8 gathered, 14,336 B sent; to 'model' along
    dim 3: an all-to-all over 'model', then 'data' gathered, 2,432 B).

    >>> _diff(((("data", "model")), (), (), ()), ((), (), (), ("data",)))
    (('data', 'model'), ())
    >>> _diff(((("data", "model")), (), (), ()), ((), (), (), ("model",)))
    (('data',), ('model',))
    """
    gather, move = [], []
    for d, axes in enumerate(actual):
        gathered, here = False, []
        for a in reversed(axes):
            if a in wanted[d]:
                continue
            if not gathered and any(a in w for w in wanted):
                move.append(a)
            else:
                here.append(a)
                gathered = True
        gather += reversed(here)  # major to minor, as the dim holds them
    return tuple(gather), tuple(move)


def execution_factors(op: Op, state: ShardingState) -> dict[int, Axes]:
    """How the op runs: its factor -> axes, agreed by its operands and results (earliest decision
    wins), or, for elementwise work and reductions, another way that moves fewer bytes (its
    operands' layout alone, or led by one linked value): XLA reshards the small value (a
    reduction's result, a broadcast scale) rather than the large one; a gather or scatter-add
    whose table holds its indices' axes runs along the indices where XLA's partitioner ranks that
    first (:func:`automap.indexed_ops.indices_first`). Operands and results that
    disagree with it are resharded before or after. A factor
    whose tiling no result can express (the minor factor of a merged dim) is not run sharded."""
    return _analysis(op, state)[0]


def _analysis(op: Op, state: ShardingState) -> Analysis:
    """(factor axes, reshard templates, pieces) of one op, memoised with its factor solution (on
    the op's rule and its linked values' specs): identical layers and revisited states hit the
    cache. ``pieces`` is how many ways the op's work is split (the product of its axes' sizes)."""
    sol = solution(op, state.axes, state.mesh_key, state.specs, state.priority)
    got = sol.analysis
    if got is None:
        sizes = state.axes
        whole = traits_of(op.primitive).runs_whole  # its operands gathered, its results sliced
        fax = {} if whole else _expressible(op, sol.fax, sizes)
        templates = _templates(op, state, fax)
        if templates and op.linked_outputs and not whole and _reshards_smallest(op):
            for alt in _alternatives(op, state):
                alt = _expressible(op, alt, sizes)
                if alt != fax:
                    other = _templates(op, state, alt)
                    if moved_bytes(other) < moved_bytes(templates):
                        fax, templates = alt, other
        if op.primitive == "dot_general" and (reordered := reordered_sum(op, state, fax, templates, _templates)):
            fax, templates = reordered
        if (split := pieces_moved(op, state, _templates)) is not None:
            templates = split
        detour = 1
        indexed = indices_first(op, state, fax, templates, _templates)
        if indexed is not None:
            fax, templates = indexed
        elif (moved := indices_moved_to_idle(op, state, fax, templates)) is not None:
            templates = moved
        if op.primitive in CONTRACTIONS:
            fax, templates, detour = as_xla_contracts(op, state, fax, templates, _templates)
        pieces = math.prod(sizes[a] for ax in fax.values() for a in ax) * detour
        got = sol.analysis = (fax, templates, pieces)
    if op.primitive == "gather":  # a lookup in a broadcast scalar: not the solution's (shared by ops of one rule)
        way = made_whole(op, state, got[0], got[1], _templates)
        if way is not None:
            return (*way, math.prod(state.axes[a] for ax in way[0].values() for a in ax))
    return got


POOLING_GRADIENTS = ("select_and_scatter_add", "select_and_scatter")


def _reshards_smallest(op: Op) -> bool:
    """Elementwise work, reductions and pooling gradients: XLA's partitioner runs them in whichever
    layout needs the least resharding (contractions, gathers and scatters have layouts of their
    own). A max-pool gradient whose (4, 4, 4, 8) source is split on its features over (data, model)
    and its (4, 8, 8, 8) input and result on the batch over data: XLA gathers the source (1,792 B
    sent); run in the source's layout it moved the input and the result (4,352 B)."""
    traits = traits_of(op.primitive)
    return traits.contraction is None and (traits.fusion != "kernel" or traits.memory == "result"
                                           or op.primitive in POOLING_GRADIENTS)


def _alternatives(op: Op, state: ShardingState) -> list[dict[int, Axes]]:
    """Other ways to run an op whose linked values disagree: in its operands' layout alone (the
    results resharded after it), and led by each linked value in turn (the others resharded)."""
    out = [solve_factors(op, state, state.specs, state.priority, operands_only=True)[0]]
    for v in dict.fromkeys(op.linked):
        spec = state.specs.get(v)
        if spec is None or not any(spec):
            continue
        lead = collections.ChainMap({(v, d): -1 for d, axes in enumerate(spec) if axes}, state.priority)
        out.append(solve_factors(op, state, state.specs, lead)[0])
    return out


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


def _retiled(actual: Spec, wanted: Spec, nbytes: int, sizes, in_groups: bool) -> tuple | None:
    """XLA's own way of moving a value from ``actual`` to ``wanted`` where it has one
    (:mod:`automap.tile_order`'s rules, the first that applies); None for a plain gather / all-to-all."""
    return (disjoint_retile(actual, wanted, nbytes, sizes, in_groups) or displaced_axes(actual, wanted, nbytes, sizes)
            or full_rematerialization(actual, wanted, nbytes, sizes) or chained_moves(actual, wanted, nbytes, sizes)
            or joined_axes(actual, wanted, nbytes, sizes))


def _templates(op: Op, state: ShardingState, fax: dict[int, Axes]) -> tuple:
    """The op's reshards as (linked position, kind, axes, bytes, where[, devices per group where a
    subgroup of the axes' devices runs it])."""
    program, sizes, rule = state.program, state.axes, op.rule
    out = []
    n_in = len(op.linked_inputs)
    in_groups = op.primitive not in INDEXED  # automap.indexed_ops prices their moves from plain gathers
    for pos, (vid, dims) in enumerate(zip(op.linked_inputs, rule.operands, strict=True)):
        if not dims:
            continue
        actual = state.spec(vid)
        wanted = compose_spec(dims, fax, rule, sizes)
        nbytes = program.values[vid].nbytes
        retiled = _retiled(actual, wanted, nbytes, sizes, in_groups)
        if retiled and retiled[-1][0] == "all-gather" and _grouped_partner_at(op, state) == pos:
            retiled = None  # gathered whole for the dot's groups, then sliced (automap.whole_gathers.grouped_partner)
        if retiled:
            out += [(pos, kind, axes, moved, "operand", *group) for kind, axes, moved, *group in retiled]
            continue
        gather, move = _diff(actual, wanted)
        if permute := tile_permute(actual, wanted, nbytes, sizes):
            out.append((pos, "collective-permute", *permute, "operand"))
        if gather:
            after = tuple(tuple(a for a in axes if a not in gather) for axes in actual)
            out.append((pos, "all-gather", gather, _per_device(nbytes, after, sizes), "operand"))
        if move:
            out.append((pos, "all-to-all", move, _per_device(nbytes, actual, sizes), "operand"))
    groups = summed_groups(op, fax)
    contraction = traits_of(op.primitive).contraction is not None
    for pos, (vid, dims) in enumerate(zip(op.linked_outputs, rule.results, strict=True)):
        if not dims and not groups:
            continue
        actual = state.spec(vid)
        implied = compose_spec(dims, fax, rule, sizes)
        nbytes = program.values[vid].nbytes
        here = n_in + pos
        if groups:
            whole = _per_device(nbytes, implied, sizes)
            for kind, axes, share in _partial_sum(groups, implied, actual, contraction, sizes):
                out.append((here, kind, axes, whole // share, "result"))
        if retiled := _retiled(implied, actual, nbytes, sizes, in_groups and not contraction):
            out += [(here, kind, axes, moved, "result", *group) for kind, axes, moved, *group in retiled]
            continue
        gather, move = _diff(implied, actual)
        if permute := tile_permute(implied, actual, nbytes, sizes):
            out.append((here, "collective-permute", *permute, "result"))
        if gather:
            out.append((here, "all-gather", gather, _per_device(nbytes, actual, sizes), "result"))
        if move:
            out.append((here, "all-to-all", move, _per_device(nbytes, implied, sizes), "result"))
    return tuple(out) + _permutation_moves(op, state, fax) + halo_moves(op, state, fax)


def _grouped_partner_at(op: Op, state: ShardingState) -> int | None:
    """The position of the operand a dot's partitioner gathers whole for its groups, if any."""
    got = grouped_partner(op, state)
    return None if got is None else 1 - got[0]


def _permutation_moves(op: Op, state: ShardingState, fax: dict[int, Axes]) -> tuple:
    """The reshards of a sharded permutation factor (a concatenation's joined dim), as XLA's
    partitioner (jax 0.10.2) moves them, measured on 2x4 meshes: an all-to-all of each operand
    sharded along the dim and one of the result (two [64, 32] pieces on 'model': 2,048 + 2,048 +
    4,096 B a device); an operand whole along it is sliced locally."""
    rule, sizes = op.rule, state.axes
    out = []
    n_in = len(op.linked_inputs)
    linked = tuple(op.linked_inputs) + tuple(op.linked_outputs)
    for f, factor in enumerate(rule.factors):
        axes = fax.get(f, ())
        if factor.kind != "permutation" or not axes:
            continue
        at = [(pos, d) for pos, dims in enumerate(rule.operands + rule.results) for d, fs in enumerate(dims) if f in fs]
        for pos, d in at:
            value = state.program.values[linked[pos]]
            if pos >= n_in or tuple(state.spec(linked[pos])[d]) == axes:
                out.append((pos, "all-to-all", axes, _per_device(value.nbytes, _implied(op, state, fax, pos), sizes),
                            "result" if pos >= n_in else "operand"))
    return tuple(out)


def _implied(op: Op, state: ShardingState, fax: dict[int, Axes], pos: int) -> Spec:
    """The spec of linked value ``pos`` (operands, then results) the op's factor axes imply."""
    dims = (op.rule.operands + op.rule.results)[pos]
    return compose_spec(dims, fax, op.rule, state.axes)


def _partial_sum(groups: list[Axes], implied: Spec, actual: Spec, contraction: bool,
                 sizes: dict[str, int]) -> list[tuple[CollectiveKind, Axes, int]]:
    """How XLA's partitioner (jax 0.10.2, mesh 2x4) sums a partial result whose reduction factors
    run on ``groups`` (one group of axes per factor) into the layout ``actual`` (the op computes
    ``implied``): (kind, axes, the share of the whole result each collective moves).

    - A contraction (its dot partitioner) whose result keeps a slice of the partial axes along one
      dim alone (that dim's further axes all partial, the computed axes a prefix) reduce-scatters
      over them first and all-reduces the rest per factor on the scattered piece: k on (data,
      model) into a result on data, a reduce-scatter over data and an all-reduce over model of
      half the result (10 KiB sent for a 8 KiB result, not 16). Kept along several dims, each
      dim's partial axes are all-reduced whole, one group at a time (k on (data, model) into rows
      on model and columns on data: an all-reduce over model and one over data, 20 KiB); kept
      along one dim with other axes (rows on (data, model), k on data), all-reduced whole.
    - Any other reduction (reduce, gather's lookup) all-reduces each factor whole, the factor of
      the lowest dim last, and slices the result: that last all-reduce is a reduce-scatter where
      the slice keeps exactly its group's share (a sum over a dim on (data, model) into a result
      on data: one all-reduce over both axes, 224 B sent for 128 B, not a reduce-scatter and an
      all-reduce, 256 B).
    Each factor's axes are all-reduced on their own, not together (a dot contracting the batch on
    'data' and the sequence on 'model': over 'model', then over 'data')."""
    partial = {a for axes in groups for a in axes}
    kept = [tuple(a for a in w if a not in i) if w[: len(i)] == i else None for i, w in zip(implied, actual)]
    if contraction:
        dims = [d for d, w in enumerate(actual) if any(a in partial for a in w)]
        if len(dims) == 1 and kept[dims[0]] and set(kept[dims[0]]) <= partial:
            scatter = kept[dims[0]]
            share = math.prod(sizes[a] for a in scatter)
            rest = [r for axes in groups if (r := tuple(a for a in axes if a not in scatter))]
            return [("reduce-scatter", scatter, 1)] + [("all-reduce", r, share) for r in rest]
        peeled = [tuple(a for a in actual[d] if a in partial) for d in dims] if len(dims) > 1 else []
        done = {a for axes in peeled for a in axes}
        rest = [r for axes in groups if (r := tuple(a for a in axes if a not in done))]
        return [("all-reduce", axes, 1) for axes in peeled + rest]
    out: list[tuple[CollectiveKind, Axes, int]] = [("all-reduce", axes, 1) for axes in reversed(groups)]
    sliced = [a for k in kept if k for a in k]
    if all(k is not None for k in kept) and sorted(sliced) == sorted(groups[0]):
        out[-1] = ("reduce-scatter", groups[0], 1)
    return out


def note_derived(new: ShardingState, old: ShardingState, changed: Iterable[int]) -> None:
    """Record that ``new`` differs from ``old`` only in the specs and priorities of the values in
    ``changed``, so that analysing ``new`` can start from ``old``'s analysis (or from the analysed
    state ``old`` itself was derived from). Nothing is recorded when neither is analysed."""
    if new.program is not old.program or new.mesh_key != old.mesh_key:
        return
    memo = old.memo
    if "analyses" in memo:
        anchor, diff = old, frozenset(changed)
    elif "origin" in memo:
        anchor, earlier = memo["origin"]
        diff = earlier.union(changed)
    else:
        return
    new.memo["origin"] = (anchor, diff)


def op_analyses(state: ShardingState) -> list[Analysis]:
    """The analysis of every op, aligned with ``state.program.walked`` (memoised on the state)."""
    memo = state.memo
    got = memo.get("analyses")
    if got is not None:
        return got
    program = state.program
    origin = memo.pop("origin", None)
    if origin is None:
        got = [_analysis(op, state) for op, _ in program.walked]
    else:
        anchor, changed = origin
        got = list(anchor.memo["analyses"])
        index, users = _walk_index(program), program.users
        for op in {op.id: op for v in changed for op in users.get(v, ())}.values():
            got[index[op.id]] = _analysis(op, state)
    memo["analyses"] = got
    return got


def _walk_index(program: Program) -> dict[int, int]:
    """op id -> its position in ``program.walked``."""
    got = program.memo.get("walk_index")
    if got is None:
        got = program.memo["walk_index"] = {op.id: i for i, (op, _) in enumerate(program.walked)}
    return got


def reshards(state: ShardingState) -> list[Reshard]:
    """Every collective the assignment implies, op by op (the cost model prices these). A gather
    of the same value over the same axes in the same region is marked ``reused`` after its first
    occurrence: XLA computes it once (CSE), except the one
    :func:`automap.gather_reuse.gathered_apart` names, and a dot grouped on its sum makes
    its own (:func:`automap.gather_reuse.grouped_on_the_sum`)."""
    program, analyses = state.program, op_analyses(state)
    walked, values = program.walked, program.values
    made = program.memo.setdefault("reshards", {})  # fields -> Reshard: one object for equal ones
    if len(made) > 200_000:
        made.clear()
    out: list[Reshard] = []
    gathered: set[tuple] = set()
    apart: set[tuple] = set()  # gathers automap.gather_reuse.gathered_apart names
    invariant, trips = loop_invariants(program)
    index = _walk_index(program)
    for i in [i for i, got in enumerate(analyses) if got[1]]:
        op, mult = walked[i]
        region = values[op.outputs[0]].region if op.outputs else 0
        linked = op.linked
        unshared = gathered_apart(op, analyses[i][1], state)
        grouped = None  # computed on the op's first gather, once
        halos = set(halo_moves(op, state, analyses[i][0])) if op.primitive in HALO_PRIMITIVES else set()
        for pos, kind, axes, nbytes, where, *group in analyses[i][1]:
            vid = linked[pos]
            count = mult
            if where == "operand" and vid in invariant:  # resharded once, at the loop's entry
                count = max(mult // trips[values[vid].region], 1)
            reused = False
            if kind == "reduce-scatter" and where == "result" and sliced_further(state, analyses, index, vid):
                kind = "all-reduce"  # XLA:CPU merges the two slices (automap.merged_slices)
            elif kind == "all-reduce" and where == "result" and sliced_once(state, analyses, index, vid, axes):
                kind = "reduce-scatter"  # the reader's slice keeps the group's share (automap.merged_slices)
            halo = (pos, kind, axes, nbytes, where, *group) in halos  # each its own (automap.conv_halos)
            if kind in ("all-gather", "collective-permute") and where == "operand" and not halo:
                if grouped is None:
                    grouped = grouped_on_the_sum(op, state, analyses[i][1]) if op.primitive == "dot_general" else ()
                key = (vid, kind, axes, region, grouped, *group)  # a gather in groups is another one
                if pos == unshared:
                    apart.add(key)
                else:  # a batch-grouped conv run whole shares even those (measured: a RegNet's kernel gradient)
                    reused = key in gathered or (key in apart and batch_groups_split_within(op, state))
                    gathered.add(key)
            fields = (op.id, vid, kind, axes, nbytes, count, where, reused, *group)
            r = made.get(fields)
            if r is None:
                r = made[fields] = Reshard(*fields)  # type: ignore[arg-type]
            out.append(r)
    return out


def analyse(state: ShardingState) -> tuple[list[tuple[Op, int, dict[int, Axes]]], list[Reshard]]:
    """Every op with its trip multiplier and execution factors, and every reshard."""
    ops = [(op, mult, fax) for (op, mult), (fax, _, _) in zip(state.program.walked, op_analyses(state), strict=True)]
    return ops, reshards(state)
