"""The halo exchanges of a convolution run split along an overlapping-window spatial dim
(:func:`automap.rules.conv_windows.windowed_spatial_dims`), as XLA's partitioner sends them.

XLA (jax 0.10.2, Shardy) keeps a conv's input split along such a dim, the output split the same
way, and sends each device the input rows its windows read beyond its own shard: one
collective-permute per side that needs rows, of those rows (more hops when a side needs more rows
than a shard holds, one shard's rows at most per hop). Measured on a 4x2 mesh, batch 2, 8
features, f32: a 3-wide stride-1 SAME conv over 16 rows split 2 or 4 ways sends 2 permutes of one
row (64 B each, 1-D; 1,024 B, 2-D 16x16); 5-wide, 2 rows a side; stride 2, 3-wide: one permute of
one row (right side only); 5-wide stride 2: 1 + 2 rows; 5-wide over 8 rows split 8 ways: 4 hops of
one row. The backward's input-gradient conv sends the same halos of the output's gradient; its
kernel-gradient conv (the cotangent the window, split with the input) the input's halos again,
then all-reduces the partial kernel gradient: 6 permutes of one row and one all-reduce in all.
"""
from __future__ import annotations

import math

from automap.factors import Axes, compose_spec
from automap.ir.program import Op
from automap.shardings import ShardingState

HALO_PRIMITIVES = frozenset({"conv_general_dilated"})  # their operand permutes are halos, each its own


def halo_rows(length: int, window: int, windows: int, stride: int, low: int, shards: int) -> tuple[int, int]:
    """``(left, right)``: the input rows a device reads beyond its shard at most, on each side,
    when a conv's ``windows`` outputs (stride ``stride``, ``low`` rows of low padding) and its
    ``length`` input rows are both split into ``shards`` equal pieces.

    >>> halo_rows(16, 3, 16, 1, 1, 2), halo_rows(16, 3, 8, 2, 0, 4), halo_rows(16, 5, 8, 2, 1, 2)
    ((1, 1), (0, 1), (1, 2))
    """
    rows, outs = length // shards, windows // shards
    left = max([k * rows - max(0, k * outs * stride - low) for k in range(1, shards)], default=0)
    right = max([min(length - 1, ((k + 1) * outs - 1) * stride + window - 1 - low) - ((k + 1) * rows - 1)
                 for k in range(shards - 1)], default=0)
    return max(left, 0), max(right, 0)


def halo_moves(op: Op, state: ShardingState, fax: dict[int, Axes]) -> tuple:
    """The collective-permutes (analysis templates ``(0, kind, axes, bytes, "operand")``) that
    bring a split conv's input its halos: per spatial dim split along the output's windows
    (:func:`~automap.rules.conv_windows.windowed_spatial_dims`) or along a window longer than the
    output (:func:`~automap.rules.conv_windows.summed_window_dims`, the output's taps sliding over
    it, stride 1), per side, ``ceil(rows / shard rows)`` hops of the shard's rows (the last hop the rest),
    each of the input shard's bytes per row; dims exchanged one after the other, a later dim's
    rows holding the earlier dims' halos. Memoised on the program per (op, factor axes, mesh).

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import op_analyses
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NHC", "HIO", "NHC"))
    >>> prog = lower(jax.make_jaxpr(conv)(jnp.ones((2, 16, 8)), jnp.ones((3, 8, 8))), ["x", "w"], ["y"])
    >>> (x, w), (y,), op = prog.inputs, prog.outputs, prog.ops[0]
    >>> rows = {x: ((), ("model",), ()), y: ((), ("model",), ())}  # 16 rows, 4 a device
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=rows)
    >>> halo_moves(op, state, op_analyses(state)[0][0])  # a 3-wide window: one row (2 x 8 x 4 B) a side
    ((0, 'collective-permute', ('model',), 64, 'operand'), (0, 'collective-permute', ('model',), 64, 'operand'))
    """
    if op.primitive not in HALO_PRIMITIVES or op.params.get("dimension_numbers") is None:
        return ()
    memo = state.program.memo.setdefault("halo_moves", {})
    key = (op.id, tuple(sorted(fax.items())), state.mesh_key)
    got = memo.get(key)
    if got is None:
        got = memo[key] = _halo_moves(op, state, fax)
    return got


def _halo_moves(op: Op, state: ShardingState, fax: dict[int, Axes]) -> tuple:
    lhs_spec, rhs_spec, out_spec = op.params["dimension_numbers"]
    rule, sizes = op.rule, state.axes
    program = state.program
    lhs = program.values[op.linked_inputs[0]]
    rhs = program.values[op.linked_inputs[1]]
    out = program.values[op.linked_outputs[0]]
    padding = op.params.get("padding") or ()
    strides = op.params.get("window_strides") or ()
    spec = compose_spec(rule.operands[0], fax, rule, sizes)
    shape = [n // math.prod(sizes[a] for a in axes) for n, axes in zip(lhs.shape, spec)]
    out_moves = []
    for i in range(len(lhs_spec) - 2):
        d, o, r = lhs_spec[2 + i], out_spec[2 + i], rhs_spec[2 + i]
        major = rule.operands[0][d][:1]
        if not major or not (axes := fax.get(major[0], ())):
            continue  # whole
        length, stride = lhs.shape[d], strides[i] if strides else 1
        if major[0] in rule.results[0][o]:  # split along the output's windows
            windows, window = out.shape[o], rhs.shape[r]
        elif major[0] in rule.operands[1][r]:  # split along the window (summed): the output's taps slide
            windows, window, stride = rhs.shape[r], out.shape[o], 1
        else:
            continue
        shards = math.prod(sizes[a] for a in axes)
        if length % shards or windows % shards or shape[d] != length // shards:
            continue
        low = padding[i][0] if i < len(padding) else 0
        sides = halo_rows(length, window, windows, stride, low, shards)
        row = lhs.itemsize * math.prod(shape) // shape[d]
        for rows in sides:
            while rows > 0:
                hop = min(rows, shape[d])
                out_moves.append((0, "collective-permute", axes, hop * row, "operand"))
                rows -= hop
        shape[d] += sum(sides)
    return tuple(out_moves)


def summed_groups(op: Op, fax: dict[int, Axes]) -> list[Axes]:
    """The axes of each reduction factor of ``op`` that runs split, as XLA all-reduces the
    partial result: one group per factor, but a conv's windows summed split along several
    spatial dims (:func:`~automap.rules.conv_windows.summed_window_dims`) in one group, where
    the first of them is (measured: a 3x3 conv's kernel gradient, rows on 'data', columns on
    'model': one all-reduce over both, 2,304 B; its batch on 'data' and rows on 'model': one
    each).

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import op_analyses
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> prog = lower(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 16)), jnp.ones((16, 4))), ["x", "w"], ["y"])
    >>> (x, w), dot = prog.inputs, prog.ops[0]
    >>> split_sum = {x: ((), ("model",)), w: (("model",), ())}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=split_sum)
    >>> summed_groups(dot, op_analyses(state)[0][0])  # the contraction summed split: one all-reduce
    [('model',)]
    """
    rule = op.rule
    windows: set[int] = set()
    if op.primitive in HALO_PRIMITIVES and op.params.get("dimension_numbers") is not None:
        rhs_spec = op.params["dimension_numbers"][1]
        windows = {f for d in rhs_spec[2:] for f in rule.operands[1][d][:1] if rule.factors[f].kind == "reduction"}
    joined = tuple(a for f in rule.reduction_factors if f in windows for a in fax.get(f, ()))
    groups: list[Axes] = []
    for f in rule.reduction_factors:
        axes = joined if f in windows else fax.get(f, ())
        if axes and axes not in groups:
            groups.append(axes)
    return groups
