"""Which way XLA's SPMD partitioner tries first to partition a gather or a scatter.

XLA (jax 0.10.2) knows several ways to partition a gather or scatter, each driven by one split:

- ``"passthrough"``: the table's split on a dim the lookups (the updates) keep whole, an
  embedding's features: each device looks up (adds into) its columns of every row;
- ``"sliced"``: the table's split on an indexed dim, its rows: each device looks up the rows it
  holds (a masked lookup, then summed over the split) or adds every update into its rows;
- ``"indices"``: the indices' split on a batch dim: each device looks up its own indices in the
  whole table (or adds its updates into a whole copy, then summed over the split).

It dry-runs each way on its own (the rest of the op replicated: every value gathered but for the
way's split, which the lookups or updates take), and scores it by the largest buffer of the op
or of one of its collectives (per device: a collective's operand and result, an all-reduce's or
a scatter's operands alone) and then by the bytes its collectives send (an all-reduce twice its
buffer, an all-gather or all-to-all the share that arrives, a collective-permute its buffer). It
tries the ways cheapest first, stably in the order above, and takes the first that applies; the
split it took then runs again, on what is left, within its groups. Read from XLA's
``gather_scatter_handler`` and ``spmd_partitioner`` (``EvaluatePartitionCost``,
``MemoryCostInBytes``, ``CommunicationCostInBytes``) and checked against the costs its verbose
log prints: a zeros table (64, 32) on (data, model), updates (8, 16, 32) on (data, -, model),
indices on both axes of the batch, mesh data=4 x model=2: passthrough (12,800, 9,664), sliced
(24,576, 15,872), indices (10,304, 24,576): along the indices, the updates' 'model' moved onto
their batch (all-to-all) and the whole table reduce-scattered; the same op on data=2 x model=4:
passthrough (6,656, 3,520), sliced (20,992, 17,920), indices (12,288, 25,088): the features keep
'model' (:func:`first_way`'s example prices them (12,800, 9,664), (18,944, 15,808), (10,304,
24,576) and (6,656, 3,520), (20,992, 17,856), (10,304, 25,088)).

XLA gathers a value split on several dims a dim at a time (the largest buffer can be the second
step); this module prices one gather per value, which ranks the ways as XLA does on the cases in
``tests/automap/cost/test_against_xla.py``.
"""
from __future__ import annotations

import math

from automap.ir.program import Op

Spec = tuple  # axes per dim

WAYS = ("passthrough", "sliced", "indices")


def first_way(op: Op, state) -> str | None:
    """The way (:data:`WAYS`) XLA's partitioner tries first on a gather or scatter-add, as its
    linked values are laid out in ``state``; None where no way applies (nothing split).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> from automap.xla_layout import xla_layout
    >>> fn = lambda i, u: jnp.zeros((64, 32)).at[i].add(u)
    >>> prog = lower(jax.make_jaxpr(fn)(jnp.zeros((8, 16), jnp.int32), jnp.ones((8, 16, 32))), ["i", "u"], ["t"])
    >>> (i, u), (t,) = prog.inputs, prog.outputs
    >>> (op,) = [op for op in prog.ops if op.primitive.startswith("scatter")]
    >>> specs = {i: (("data", "model"), ()), u: (("data",), (), ("model",)), t: (("data",), ("model",))}
    >>> for mesh in ({"data": 4, "model": 2}, {"data": 2, "model": 4}):
    ...     state = xla_layout(ShardingState.initial(prog, mesh).replace(specs=specs))
    ...     print(way_costs(op, state), first_way(op, state))
    {'passthrough': (12800, 9664), 'sliced': (18944, 15808), 'indices': (10304, 24576)} indices
    {'passthrough': (6656, 3520), 'sliced': (20992, 17856), 'indices': (10304, 25088)} passthrough
    """
    costs = way_costs(op, state)
    return min(costs, key=costs.__getitem__) if costs else None  # min keeps the first of equals


def way_costs(op: Op, state) -> dict[str, tuple[int, int]]:
    """{way: (largest buffer, bytes sent)} of each way that applies, in :data:`WAYS` order, as
    XLA's partitioner prices it (module docstring; :func:`first_way`'s example prints them)."""
    rule, sizes, values = op.rule, state.axes, state.program.values
    scatter = op.primitive != "gather"
    if len(op.linked_inputs) < (3 if scatter else 2) or not op.linked_outputs:
        return {}
    table, indices = op.linked_inputs[:2]
    if scatter:
        partner, partner_dims = op.linked_inputs[2], rule.operands[2]
    else:
        partner, partner_dims = op.linked_outputs[0], rule.results[0]
    kept = {f for fs in partner_dims for f in fs}  # the factors the lookups (the updates) keep
    table_dims, index_dims = rule.operands[0], rule.operands[1]
    t_spec, i_spec, p_spec = state.spec(table), state.spec(indices), state.spec(partner)
    whole = lambda spec: tuple(() for _ in spec)  # noqa: E731

    def partner_with(dims, spec, dims_factors) -> Spec:
        """The lookups' (updates') spec that takes ``spec``'s axes of the dims ``dims`` (of the
        table or the indices, whose factors are ``dims_factors``) on their factors' dims."""
        axes_of = {f: spec[d] for d in dims for f in dims_factors[d]}
        return tuple(next((axes_of[f] for f in fs if f in axes_of), ()) for fs in partner_dims)

    out: dict[str, tuple[int, int]] = {}
    for way in WAYS:
        if way == "indices":
            split = [d for d, fs in enumerate(index_dims) if i_spec[d] and set(fs) & kept]
            t_way, i_way = whole(t_spec), tuple(i_spec[d] if d in split else () for d in range(len(i_spec)))
            p_way = partner_with(split, i_spec, index_dims)
        else:
            on_kept = way == "passthrough"
            split = [d for d, fs in enumerate(table_dims) if t_spec[d] and fs and (set(fs) <= kept) == on_kept]
            t_way, i_way = tuple(t_spec[d] if d in split else () for d in range(len(t_spec))), whole(i_spec)
            p_way = partner_with(split, t_spec, table_dims) if on_kept else whole(p_spec)
        if not split:
            continue
        group = math.prod(sizes[a] for d in split for a in (i_spec if way == "indices" else t_spec)[d])
        steps = [*_reshard(values[table].nbytes, t_spec, t_way, sizes),
                 *_reshard(values[indices].nbytes, i_spec, i_way, sizes),
                 *_reshard(values[partner].nbytes, p_spec, p_way, sizes)]
        piece = lambda vid, spec: values[vid].nbytes // _ways(spec, sizes)  # noqa: E731
        t_piece, i_piece, p_piece = piece(table, t_way), piece(indices, i_way), piece(partner, p_way)
        result, result_way = (op.linked_outputs[0], t_way) if scatter else (partner, p_way)
        summed = way == ("indices" if scatter else "sliced")  # partial results, summed over the split
        if summed:
            result_way = whole(result_way)
        op_bytes = t_piece + i_piece + p_piece if scatter else t_piece + i_piece + piece(result, result_way)
        if summed:
            summed_bytes = piece(result, result_way)
            steps.append((summed_bytes, 2 * summed_bytes if group > 1 else 0))
        steps += _reshard(values[result].nbytes, result_way, state.spec(result), sizes)
        out[way] = (max([op_bytes] + [m for m, _ in steps]), sum(c for _, c in steps))
    return out


def _ways(spec: Spec, sizes) -> int:
    return math.prod(sizes[a] for axes in spec for a in axes)


def _reshard(nbytes: int, have: Spec, want: Spec, sizes) -> list[tuple[int, int]]:
    """[(buffer, bytes sent)] of the collectives taking a value from ``have`` to ``want``: the
    axes it loses gathered (one all-gather), those that change dims moved (an all-to-all); an
    axis it gains is a slice, free."""
    where = {a: d for d, axes in enumerate(want) for a in axes}
    gathered = [a for d, axes in enumerate(have) for a in axes if a not in where]
    moved = [a for d, axes in enumerate(have) for a in axes if a in where and where[a] != d]
    piece, out = nbytes // _ways(have, sizes), []
    if gathered:
        n = math.prod(sizes[a] for a in gathered)
        out.append((piece + piece * n, piece * (n - 1)))
        piece *= n
    if moved:
        n = math.prod(sizes[a] for a in moved)
        out.append((2 * piece, piece * (n - 1) // n))
    return out
