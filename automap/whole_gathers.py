"""Contractions XLA's dot partitioner (jax 0.10.2) runs with an operand split along the sum
gathered whole, rather than summing partial results: against a partner whole on every mesh
axis, or one that splits a free dim over an axis the sum is split on. A rule of
:func:`automap.contraction_layouts.as_xla_contracts`.
"""
from __future__ import annotations

from automap.factors import Axes
from automap.ir.program import Op


def whole_partner_gathers(op: Op, state, fax: dict[int, Axes], templates_of) -> tuple[dict, tuple] | None:
    """(factor axes, templates) of a contraction whose summed dims one operand splits while the
    other operand is whole on every mesh axis, as XLA's dot partitioner runs it: the split operand
    all-gathered and the dot run whole on those axes, rather than partial results summed; no
    detour over an idle axis; a result wanted split over the gathered axes on a dim of the whole
    operand computed so (the whole operand sliced). Measured on jax 0.10.2: ``ecd,tec->td`` and
    ``mk,kn->mn`` with the split operand 0.6x to 32x the result, over 'model' and over 'data'
    ('model' idle), the result whole or split on a dim of the whole operand (the routed tokens of
    a Switch MoE whose batch stays whole). None where it does not apply: the other operand split
    on some axis (but where :func:`_partner_on_the_sums_axes` finds it contends for the sum's
    axes), the split operand split on a dim it keeps too (``exp(x) @ w``, its rows on 'data'
    and its features on 'model': XLA all-reduces the partial result over 'model'), or the result
    wanting the gathered axes on a dim of the split operand (XLA does otherwise there).

    What it makes of ``x @ w``, ``x`` split on the sum over 'model' and ``w`` whole (through
    :func:`automap.analysis.reshards`, which applies it): ``x`` gathered, no partial sums.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import reshards
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> prog = lower(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 16)), jnp.ones((16, 64))), ["x", "w"], ["y"])
    >>> (x, w), (y,) = prog.inputs, prog.outputs
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4})
    >>> specs = {x: ((), ("model",)), w: ((), ()), y: ((), ())}
    >>> [(r.kind, r.axes, r.bytes) for r in reshards(state.replace(specs=specs))]
    [('all-gather', ('model',), 512)]
    """
    rule = op.rule
    summed = {a for f in rule.reduction_factors for a in fax.get(f, ())}
    if not summed or len(op.linked_inputs) != 2:
        return None
    whole = [i for i, v in enumerate(op.linked_inputs) if not any(state.spec(v))]
    if len(whole) != 1 and (whole := _partner_on_the_sums_axes(op, state)) is None:
        return None
    split, split_dims = op.linked_inputs[1 - whole[0]], rule.operands[1 - whole[0]]
    reduction = set(rule.reduction_factors)
    if any(axes and not set(fs) <= reduction for axes, fs in zip(state.spec(split), split_dims, strict=True)):
        return None  # split on a kept dim too (rows on data, the sum on model): XLA sums partial results
    split_factors = {f for fs in split_dims for f in fs}
    for v, dims in zip(op.linked_outputs, rule.results, strict=True):
        for axes, fs in zip(state.spec(v), dims, strict=True):
            if summed & set(axes) and split_factors & set(fs):
                return None
    alt = {f: kept for f, axes in fax.items() if (kept := tuple(a for a in axes if a not in summed))}
    for v, dims in zip(op.linked_outputs, rule.results, strict=True):  # the result's slice of the whole operand
        for axes, fs in zip(state.spec(v), dims, strict=True):
            if len(fs) == 1 and fs[0] not in alt and set(axes) <= summed and axes:
                alt[fs[0]] = axes
    return alt, templates_of(op, state, alt)


def _partner_on_the_sums_axes(op: Op, state) -> list[int] | None:
    """[the position of the operand] of a two-operand contraction that splits free dims alone,
    over an axis the other operand splits its summed dims on (the other split on them alone): XLA's
    dot partitioner gathers that other operand whole, as it gathers it against a whole partner
    (:func:`whole_partner_gathers`), rather than gathering the contended axis alone and summing
    partial results over the rest. Measured on jax 0.10.2, meshes 2x4 and 4x2, ``bsh,hd->bsd``
    (a dense layer's forward), ``h``'s batch on 'model' or 'data', ``k``'s rows on ('data',
    'model') or ('model', 'data'), ``k`` 1/4 of ``h`` or twice it: ``k`` gathered whole over both
    axes every time (the estimate gathered the minor axis where the batch holds it and
    all-reduced the result over the other: 0.36-0.71x XLA's bytes sent, 1/4-1/2 its dot FLOPs)."""
    if len(op.linked_inputs) != 2:
        return None
    summed = set(op.rule.reduction_factors)
    held_on = []  # per operand: (axes on summed dims, axes on free dims)
    for vid, dims in zip(op.linked_inputs, op.rule.operands, strict=True):
        on_sum = {a for axes, fs in zip(state.spec(vid), dims, strict=True) if fs and set(fs) <= summed for a in axes}
        on_free = {a for axes, fs in zip(state.spec(vid), dims, strict=True) if not (fs and set(fs) <= summed) for a in axes}
        held_on.append((on_sum, on_free))
    for pos in (0, 1):
        (_, free), (other_sum, other_free) = held_on[pos], held_on[1 - pos]
        if not held_on[pos][0] and free & other_sum and other_sum and not other_free:
            return [pos]
    return None
