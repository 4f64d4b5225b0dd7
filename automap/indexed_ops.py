"""How XLA's SPMD partitioner runs a gather or a scatter-add whose indices and table disagree.

A gather's (a lookup's) indexed dim is a reduction factor of its rule (each device looks up the
rows it holds: a masked lookup whose partial results are summed), a scatter-add's indexed dim a
parallel factor of its operand and result (each device adds into the rows it holds) while the
updates' batch dims are reductions. When the indices are split over mesh axes the table also
holds, the rule's solution keeps the earlier decision (often the table's) and gathers the
indices, the updates and the lookups. XLA (jax 0.10.2, Shardy) tries each way to partition the
op on its own and takes the one whose largest buffer (operands and result of the op or of one
of its collectives, per device) is smallest, then the one moving fewest bytes
(``GatherPartitionMethodsOrderedByCost`` in its ``gather_scatter_handler``; :func:`xla_cost`).
Where its ranking of the ways, each dry-run alone, puts the indices' split first
(:func:`automap.xla_indexed_ranking.first_way`), it runs along all the indices' axes, none kept
on a passed-through dim, whatever the solution's way costs.
Run along the indices (measured on 8 CPU devices, mesh 2x4, a (64, 32) table, 256 indices):

- the index-parallel factors take the indices' axes (extended by the lookup's result, or the
  scatter's updates, where they split them further); the table loses them, but for the axes it
  holds on a dim the lookup (the updates) keeps and holds there too, where XLA ranks that split
  (operand passthrough) first: XLA partitions an axis at a time, and such an axis passes
  through, the indices gathered over it (an FSDP embedding whose table and lookups have their
  features on 'model' and the tokens their batch on both axes, mesh 2x4; on 4x2 the tokens'
  split ranks first and 'model' moves onto the lookups' batch);
- with no mesh axis left idle, the table is all-gathered over those axes (a gather's table, a
  scatter-add's operand unless it is a broadcast of a scalar, which XLA makes in any layout) and
  a scatter-add's partial result is reduce-scattered (or all-reduced) into place;
- with an idle axis (on no factor and no linked value: a 2x4 mesh whose table and indices are
  both on 'data'), the table's split on its indexed dim moves onto the idle devices instead of
  being gathered: a collective-permute of its piece (preceded by an all-gather over the lost axes
  to the piece's new size where the idle axes are fewer devices), a masked lookup whose result
  is all-reduced over the idle axes; a scatter-add adds into the moved piece, all-reduces it over
  the indices' axes and permutes it into place.

Against the solution's way this wins where the table's indexed dim held the axes (the lookups
or updates, larger than the table, would be gathered or reduced whole), and loses where the
table holds them on a dim it passes through, an embedding's features, unless the updates are
large: 32 updates on 'data' into a table whose features are on 'data' move to the features;
256 are added along the indices and reduce-scattered.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from automap.factors import Axes, compose_dim, split_dim
from automap.ir.program import Op, Program
from automap.xla_indexed_ranking import first_way

INDEXED = frozenset({"gather", "scatter-add", "scatter_add"})

Templates = tuple  # (linked position, kind, axes, bytes, where), as automap.analysis makes them


def indices_first(op: Op, state, fax: dict[int, Axes], planned: Templates,
                  templates: Callable[[Op, object, dict[int, Axes]], Templates]) -> tuple[dict, Templates] | None:
    """(factor axes, reshard templates) of a gather or scatter-add run along its indices' split as
    XLA runs it (module docstring), where XLA's partitioner prefers that to the solution's way
    (``fax``, reshards ``planned``; :func:`xla_cost`); None where it does not, where the solution
    already runs along the indices, or where the op is neither.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import reshards
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> from automap.xla_layout import xla_layout
    >>> prog = lower(jax.make_jaxpr(lambda t, i: t[i])(jnp.ones((64, 32)), jnp.zeros(256, jnp.int32)), ["t", "i"], ["y"])
    >>> (t, i), (y,) = prog.inputs, prog.outputs
    >>> rows = (("data", "model"),)  # the table, the indices and the lookups on both axes
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs={t: rows + ((),), i: rows, y: rows + ((),)})
    >>> [(r.kind, r.axes, r.bytes) for r in reshards(xla_layout(state))]  # the 8 KiB table gathered, not the 32 KiB lookups
    [('all-gather', ('data', 'model'), 8192)]
    """
    if op.primitive not in INDEXED or len(op.linked_inputs) < 2:
        return None
    rule, sizes = op.rule, state.axes
    scatter = op.primitive != "gather"
    index_factors = {f for fs in rule.operands[1] for f in fs}
    # the indices' split, extended by the lookup's result (the scatter's updates) where it goes further
    partner = (op.linked_inputs[2], rule.operands[2]) if scatter and len(op.linked_inputs) > 2 else (
        op.linked_outputs[0], rule.results[0])
    passed = {f for fs in partner[1] for f in fs}  # the table's dims the lookup (the updates) keep
    # XLA partitions an axis at a time: an axis the table and the lookup (the updates) both hold on
    # a dim passed through stays there, and the indices are gathered over it, unless XLA ranks the
    # indices' split first (then it takes all their axes)
    along_indices = first_way(op, state) == "indices"  # XLA's first way takes every axis of the indices
    through = set() if along_indices else {
        a for f, axes in _factor_axes(op, state, *partner).items() if f in passed for a in set(axes) & set(fax.get(f, ()))}
    want: dict[int, Axes] = {}
    for vid, dims in ((op.linked_inputs[1], rule.operands[1]), partner):
        for f, got in _factor_axes(op, state, vid, dims).items():
            got, have = tuple(a for a in got if a not in through), want.get(f, ())
            if f in index_factors and (f in want or vid == op.linked_inputs[1]) and (
                    len(got) > len(have) and got[: len(have)] == have):
                want[f] = got
    if not want and scatter:
        want = _rows_on_the_indices(op, state, fax, passed, through)
    taken = {a for axes in want.values() for a in axes}
    if not want or all(fax.get(f, ()) == axes for f, axes in want.items()):
        return None
    alt = {f: kept for f, axes in fax.items() if f not in want and (kept := tuple(a for a in axes if a not in taken))}
    alt.update(want)
    indexed = [f for f, axes in fax.items() if f not in want and f not in passed and set(axes) & taken]
    used = {a for axes in alt.values() for a in axes} | {a for v in op.linked for axes in state.spec(v) for a in axes}
    idle = tuple(a for a, n in sizes.items() if n > 1 and a not in used)
    table = op.linked_inputs[0]
    free_table = scatter and _scalar_broadcast(state.program, table)
    alone = {f: axes for f, axes in alt.items() if f not in indexed}
    if not indexed or not idle or rule.factors[indexed[0]].size % math.prod(sizes[a] for a in idle):
        out = tuple(t for t in templates(op, state, alt) if not (free_table and t[0] == 0))
    else:
        out = _moved_to_idle(op, state, fax, alt, indexed[0], idle, taken, free_table, templates)
    # XLA ranks each way on its own, the rest of the op replicated: along the indices, the table whole
    if along_indices or xla_cost(op, state, alone, templates(op, state, alone)) < xla_cost(op, state, fax, planned):
        return alt, out
    return None


def made_whole(op: Op, state, fax: dict[int, Axes], planned: Templates,
               templates: Callable) -> tuple[dict, Templates] | None:
    """(factor axes, reshard templates) of a lookup in a broadcast of a scalar (segment_max's
    initial table): XLA makes the table whole on every device, so the lookup runs without its indexed dims' axes, masks and all-reduce
    (measured on 8 CPU devices: a (64, 32) table split on 'data' by another user, 256 indices
    whole: nothing sent, where the solution's masked lookup all-reduced 32 KiB); the table moves
    nothing. None where the op is no such lookup, or where the solution's way (``fax``, reshards
    ``planned``) is that already."""
    if op.primitive != "gather" or not _scalar_broadcast(state.program, op.linked_inputs[0]):
        return None
    kept = {f for fs in op.rule.results[0] for f in fs} | {f for fs in op.rule.operands[1] for f in fs}
    alt = {f: axes for f, axes in fax.items() if f in kept}
    out = tuple(t for t in (planned if alt == fax else templates(op, state, alt)) if t[0] != 0)
    if alt == fax and len(out) == len(planned):
        return None
    return alt, out


def _rows_on_the_indices(op: Op, state, fax: dict[int, Axes], passed: set[int], through: set[str]) -> dict[int, Axes]:
    """{index factor: axes}: a scatter-add whose indices are split only over axes the table and
    the updates hold on a dim passed through (an FSDP embedding's features), and whose table holds
    its rows over axes nothing else in the op holds: XLA runs it along the indices on the rows'
    axes (the indices moved there, the updates sliced, each device adding into the whole rows,
    the partial table reduce-scattered into place; measured on 8 CPU devices, a (64, 32) table
    on (model, data), 128 indices on data: 2 KiB reduce-scattered over model). The rows' axes go
    to the first index factor they divide; {} where that does not apply."""
    rule, sizes = op.rule, state.axes
    indices = _factor_axes(op, state, op.linked_inputs[1], rule.operands[1])
    if not indices or not all(set(axes) <= through for axes in indices.values()):
        return {}
    held = {a for v in op.linked_inputs[1:] for axes in state.spec(v) for a in axes}
    rows = tuple(a for f, axes in fax.items() if f not in passed and rule.factors[f].kind == "parallel"
                 for a in axes if a not in held)
    n = math.prod(sizes[a] for a in rows)
    for f in dict.fromkeys(f for fs in rule.operands[1] for f in fs):
        if rows and rule.factors[f].size % n == 0:
            return {f: rows}
    return {}


def _moved_to_idle(op: Op, state, fax: dict[int, Axes], alt: dict[int, Axes], loser: int, idle: Axes,
                   taken: set[str], free_table: bool, templates: Callable) -> Templates:
    """The reshards of ``alt`` with the table's lost split on its indexed dim moved onto the idle
    axes (module docstring); ``alt`` gains them."""
    sizes, scatter = state.axes, op.primitive != "gather"
    lost = tuple(a for a in sizes if a in fax[loser] and a in taken)
    n_lost, n_idle = math.prod(sizes[a] for a in lost), math.prod(sizes[a] for a in idle)
    alt[loser] = alt.get(loser, ()) + idle
    both = tuple(a for a in sizes if a in lost or a in idle)
    piece = _piece(state, op.linked_inputs[0])
    out = []
    for t in templates(op, state, alt):
        pos, kind, axes, nbytes, where, *_ = t
        if pos == 0 and where == "operand":  # the table moved onto the idle devices, not gathered
            if not free_table:
                if n_idle < n_lost:
                    out.append((0, "all-gather", lost, piece * n_lost // n_idle, where, n_lost // n_idle))
                out.append((0, "collective-permute", both, piece, where))
        elif scatter and where == "result":  # summed over the indices' axes, then permuted into place
            result = _piece(state, op.linked[pos])
            if kind in ("all-reduce", "reduce-scatter"):
                out.append((pos, "all-reduce", axes, result * n_lost // min(n_idle, n_lost), where))
            elif kind == "all-gather" and set(axes) <= set(idle):
                out.append((pos, "collective-permute", both, result, where))
            else:
                out.append(t)
        elif not scatter and kind == "all-reduce" and set(axes) <= set(idle) and n_idle > n_lost:
            out.append((pos, kind, axes, nbytes, where, n_lost))  # the piece sits on |lost| of the idle devices
        else:
            out.append(t)
    return tuple(out)


def xla_cost(op: Op, state, fax: dict[int, Axes], reshards: Templates) -> tuple[int, int]:
    """How XLA's partitioner ranks ways to run a gather or scatter (its cost model, jax 0.10.2):
    (the largest buffer footprint, operands and result per device, of the op and of each of its
    collectives; the bytes the collectives move), compared in that order: memory first.

    The lookup of :func:`indices_first`'s example, run in the table's split (each device looks up
    the rows it holds; the 32 KiB of partial lookups reduce-scattered) and along the indices (the
    8 KiB table gathered): the second is XLA's, with the smaller largest buffer.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import _templates
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> prog = lower(jax.make_jaxpr(lambda t, i: t[i])(jnp.ones((64, 32)), jnp.zeros(256, jnp.int32)), ["t", "i"], ["y"])
    >>> (t, i), (y,) = prog.inputs, prog.outputs
    >>> rows = (("data", "model"),)
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs={t: rows + ((),), i: rows, y: rows + ((),)})
    >>> (op,) = [op for op in prog.ops if op.primitive == "gather"]
    >>> table_rows, indices = {0: ("data", "model")}, {2: ("data", "model")}  # the factor of each way
    >>> [xla_cost(op, state, fax, _templates(op, state, fax)) for fax in (table_rows, indices)]
    [(36864, 32768), (12416, 8192)]
    """
    sizes, rule = state.axes, op.rule
    values = state.program.values
    op_bytes = 0
    for vid, dims in zip(op.linked, rule.operands + rule.results, strict=True):
        axes = [a for fs in dims for a in compose_dim(fs, fax, rule, sizes)]
        op_bytes += values[vid].nbytes // math.prod(sizes[a] for a in axes)
    peak, moved = op_bytes, 0
    for _, kind, axes, nbytes, _, *group in reshards:
        n = group[0] if group else math.prod(sizes[a] for a in axes)
        peak = max(peak, nbytes + (nbytes // n if kind in ("all-gather", "reduce-scatter") else nbytes))
        moved += nbytes
    return peak, moved


def _factor_axes(op: Op, state, vid: int, dims) -> dict[int, Axes]:
    """The axes of each of the op's factors in a linked value's spec."""
    out: dict[int, Axes] = {}
    for axes, fs in zip(state.spec(vid), dims, strict=True):
        if axes and fs:
            out.update(split_dim(axes, fs, op.rule, state.axes))
    return out


def _piece(state, vid: int) -> int:
    """Bytes per device of a value in its layout."""
    value = state.program.values[vid]
    return value.nbytes // math.prod(state.axes[a] for axes in state.spec(vid) for a in axes)


def _scalar_broadcast(program: Program, vid: int) -> bool:
    """Whether the value is a broadcast of a scalar (a scatter-add's zeros): XLA makes it in any layout."""
    made: Mapping[int, bool] | None = program.memo.get("scalar_broadcasts")
    if made is None:
        made = program.memo["scalar_broadcasts"] = {
            v: op.primitive == "broadcast_in_dim" and bool(op.inputs) and program.values[op.inputs[0]].ndim == 0
            for op in program.all_ops for v in op.outputs}
    return made.get(vid, False)


def indices_moved_to_idle(op: Op, state, fax: dict[int, Axes], planned: Templates) -> Templates | None:
    """The reshards of a gather or scatter-add run in the table's split on its indexed dim (XLA's
    trivially sliced operand, ranked first: :func:`automap.xla_indexed_ranking.first_way`) whose
    indices (and updates) the solution gathers over the table's axes, where a mesh axis is idle
    (on no factor and no linked value): XLA moves the indices' piece onto the idle devices instead
    (a collective-permute: each table piece's devices hold every index piece), looks up masked and
    all-reduces the lookups' piece over the table's axes, then permutes it into place; a
    scatter-add's updates are permuted alike and its partial table all-reduced over the idle
    devices holding distinct pieces (or, where the updates hold the table's axes on the table's
    own dims, its features, the moved updates all-gathered over them: :func:`_on_the_table_dims`).
    With the indices whole, a lookup wanted on the table's axes (its features) is still summed on
    the idle devices: its piece (split no more ways than the idle devices allow) all-reduced over
    the table's axes and permuted into place (measured on 8 CPU devices, a (64, 32) table's rows
    and its 320 lookups' features on 'data' of the 2x4 mesh: 20 KiB all-reduced, 20 KiB permuted;
    on 'model': 20 KiB all-reduced, the 10 KiB piece permuted; the held-out jraph GNN's
    ``fsdp_tp``). None where that does not apply.

    Measured on 8 CPU devices, mesh data=2 x model=4: a MoE's top-2 pick ``outs[idx, iota(8),
    iota(16)]`` of (4, 8, 16, 32) expert outputs on (-, data, -, -), the tokens on 'data': the
    3 KiB indices permuted, the 16 KiB lookups all-reduced over 'data' and permuted back, the
    gradient's 16 KiB updates permuted and its 32 KiB table all-reduced over pairs of 'model'
    devices (the solution gathered the indices and updates and reduce-scattered the lookups).
    Each of 8 tokens picks one of 4 experts' outputs (XLA's collectives, the same):

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import reshards
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> from automap.xla_layout import xla_layout
    >>> fn = lambda t, i: t[i, jnp.arange(8)]
    >>> prog = lower(jax.make_jaxpr(fn)(jnp.ones((4, 8, 32)), jnp.zeros(8, jnp.int32)), ["t", "i"], ["y"])
    >>> (t, i), (y,) = prog.inputs, prog.outputs
    >>> specs = {t: ((), ("data",), ()), i: (("data",),), y: (("data",), ())}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=specs)
    >>> [(r.kind, r.axes, r.bytes) for r in reshards(xla_layout(state))]
    [('collective-permute', ('data', 'model'), 32), ('all-reduce', ('data',), 512), ('collective-permute', ('data', 'model'), 512)]
    """
    if op.primitive not in INDEXED or len(op.linked_inputs) < 2 or first_way(op, state) != "sliced":
        return None
    rule, sizes = op.rule, state.axes
    scatter = op.primitive != "gather"
    partner_dims = rule.operands[2] if scatter and len(op.linked_inputs) > 2 else rule.results[0]
    passed = {f for fs in partner_dims for f in fs}
    lost = tuple(a for a in sizes if any(a in axes for f, axes in fax.items() if f not in passed))
    used = {a for axes in fax.values() for a in axes} | {a for v in op.linked for axes in state.spec(v) for a in axes}
    idle = tuple(a for a, n in sizes.items() if n > 1 and a not in used)
    n_lost, n_idle = math.prod(sizes[a] for a in lost), math.prod(sizes[a] for a in idle)
    if not lost or not idle:
        return None
    both = tuple(a for a in sizes if a in lost or a in idle)
    moved = (1, 2) if scatter else (1,)  # the indices (and the updates) that the solution gathers
    out, changed = [], False
    for t in planned:
        pos, kind, axes, nbytes, where, *_ = t
        if pos in moved and where == "operand" and kind == "all-gather" and set(axes) == set(lost):
            if n_idle % n_lost:
                return None  # the indices' piece onto fewer idle devices: not measured
            out.append((pos, "collective-permute", both, _piece(state, op.linked[pos]), where))
            changed = True
        elif not scatter and where == "result" and kind == "reduce-scatter" and set(axes) == set(lost):
            # the lookups' piece laid on the idle devices (no more of them than it has), summed, then permuted
            out += [(pos, "all-reduce", axes, nbytes // min(n_lost, n_idle), where),
                    (pos, "collective-permute", both, nbytes // n_lost, where)]
            changed = True
        elif not scatter and where == "result" and kind in ("all-reduce", "reduce-scatter"):
            return None  # the lookups wanted in another layout: not measured
        else:
            out.append(t)
    if not changed:
        return None
    if scatter and _on_the_table_dims(op, state, lost):  # the moved updates gathered whole over the idle devices
        out.append((2, "all-gather", idle, _piece(state, op.linked_inputs[2]) * n_lost, "operand", n_lost))
    elif scatter:  # each device added its piece of the updates: summed over the idle devices holding distinct pieces
        result = len(op.linked_inputs)
        out.append((result, "all-reduce", idle, _piece(state, op.linked[result]), "result", n_lost))
    return tuple(out)


def _on_the_table_dims(op: Op, state, lost: Axes) -> bool:
    """Whether a scatter-add's updates hold the axes ``lost`` on dims the table has too (its
    features, not the indices' batch): XLA gathers the updates it moved onto the idle devices
    over them instead of summing the table there (measured on 8 CPU devices, mesh 2x4: a (4, 32)
    table on 'data', 256 updates with their features on 'data', the indices whole: the 16 KiB
    piece permuted, then all-gathered over pairs of 'model' devices, 32 KiB sent in all)."""
    if len(op.linked_inputs) < 3:
        return False
    table = {f for fs in op.rule.results[0] for f in fs}
    held = _factor_axes(op, state, op.linked_inputs[2], op.rule.operands[2])
    moved = {f for f, axes in held.items() if set(axes) & set(lost)}
    return bool(moved) and moved <= table
