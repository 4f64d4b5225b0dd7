"""Contractions XLA's dot partitioner (jax 0.10.2) runs with an operand split along the sum
gathered whole, rather than summing partial results: against a partner whole on every mesh
axis, or one that splits a free dim over an axis the sum is split on, or, within the groups of
devices a free dim shared with the result makes, against a partner whole in the group and a
result larger than the operand or a sum split over part of the group (the groups a batch dim
makes too), or a result splitting the partner's free dims over the whole group. Rules of
:func:`automap.contraction_layouts.as_xla_contracts`.
"""
from __future__ import annotations

import math

from automap.factors import Axes, split_dim
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


def grouped_sum_gathers(op: Op, state, fax: dict[int, Axes], templates_of) -> tuple[dict, tuple] | None:
    """(factor axes, templates) of a dot whose operand ``s`` splits a free dim as the result does
    (over axes G) and its summed dims over every other mesh axis (A), the result holding nothing
    else and the partner holding G alone, or nothing: XLA's dot partitioner groups the devices by
    G, gathers the partner whole within each group (it keeps a split there only where the axes it
    leaves idle are a multiple of G, ``GetNonContractingPartitionGroupedShardingForOtherOperand``),
    and in the group, ``s`` split on the sum against a whole partner and a whole result, sums
    partial results over A only where ``s`` has more elements than the result (its base case's
    ``should_partition_contracting_dim``); otherwise it gathers ``s`` over A and runs the sum
    whole. Where ``s`` splits the sum over part of the other axes alone (A short of them: an axis,
    or a sub-axis of one, idle in the group), the base case partitions no contraction and ``s``
    is gathered whatever the sizes: measured on jax 0.10.2, ``bsk,kn->bsn``, mesh data x a x b
    (2x2x2), ``s``'s rows on 'data' and its sum on 'a' or on 'b', the result 1/4 or twice ``s``:
    gathered every time (the held-out Hugging Face Llama's grouped-query key and value
    projections under ``megatron_dp``, their input gradients split on "model":(1)2 by the two
    key/value heads: 0.95x XLA's dot FLOPs, 1.10x its bytes sent). Measured on jax 0.10.2,
    ``il,jkl->ijk`` (a dense layer's forward, the weight's rows on
    'data' and columns on 'model', the result's rows on 'data'), the activation whole, its features
    or its batch on 'data', mesh 4x2 and 2x4: the weight gathered over 'model' where it is 1/4 or
    1/2 of the result, partial results all-reduced where it is 4x the result, the activation's
    features on 'data' of 2 kept by a permute onto 'model' of 4 (the estimate all-reduced the
    result every time: the held-out equinox RoPE attention's q/k/v projections under ``fsdp_tp``
    on 4x2, 0.89x XLA's dot FLOPs). None where it does not apply.

    >>> import jax, jax.numpy as jnp
    >>> from automap.analysis import reshards
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> f = lambda w, x: jnp.einsum("il,jkl->ijk", w, x)
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((32, 32)), jnp.ones((8, 16, 32))), ["w", "x"], ["y"])
    >>> (w, x), (y,) = prog.inputs, prog.outputs
    >>> state = ShardingState.initial(prog, {"data": 4, "model": 2})
    >>> specs = {w: (("data",), ("model",)), x: ((), (), ()), y: (("data",), (), ())}
    >>> [(r.kind, r.axes, r.bytes) for r in reshards(state.replace(specs=specs))]  # w gathered, no sum
    [('all-gather', ('model',), 1024)]
    """
    free = summed_whole_in_groups(op, state)
    if free is None:
        free = summed_whole_in_batch_groups(op, state)
    return None if free is None else (free, templates_of(op, state, free))


def summed_whole_in_batch_groups(op: Op, state) -> dict[int, Axes] | None:
    """The free factor -> axes of a dot whose operand ``s`` splits batch dims (dims both operands
    hold) as the result splits them, over axes G, and its summed dims over other axes, the result
    holding nothing else: XLA's dot partitioner groups the devices by the batch split, the partner
    resharded into the groups, and in each group, ``s`` split on the sum against a partner and a
    result whole there, runs its base case (:func:`summed_whole_in_groups`): partial results summed
    only where ``s`` has more elements than the result, else ``s`` gathered over the sum and the
    dot run whole on it. A partner split on other dims over the sum's axes too (its batch dim that
    ``s`` keeps whole) XLA gathers whole, and ``s`` with it, whatever the sizes. Measured on jax
    0.10.2, mesh 2x2x2, an attention's backward ``bhdq,bkhd->bhqk`` (the heads on ('data', 'a'),
    the head dim summed on 'b'), the partner whole, on the heads alike or its batch on all 8: ``s``
    gathered over 'b' for 17 queries (the result 2x ``s``) every time, and for 4 queries of a head
    dim of 64 only against the partner on its batch (the held-out Hugging Face ViT's ``manual_fsdp``:
    the estimate all-reduced the result over 'b', 9,248 B a layer against XLA's 2,176 B gather,
    half its dot FLOPs). None where it does not apply."""
    if op.primitive != "dot_general" or len(op.linked_inputs) != 2 or len(op.linked_outputs) != 1:
        return None
    rule, sizes = op.rule, state.axes
    summed = set(rule.reduction_factors)
    out = op.linked_outputs[0]
    out_fax = _factor_axes(state.spec(out), rule.results[0], rule, sizes)
    for pos in (0, 1):
        split, partner = op.linked_inputs[pos], op.linked_inputs[1 - pos]
        split_fax = _factor_axes(state.spec(split), rule.operands[pos], rule, sizes)
        free = {f: axes for f, axes in split_fax.items() if f not in summed}
        on_sum = {a for f, axes in split_fax.items() if f in summed for a in axes}
        partner_factors = {f for fs in rule.operands[1 - pos] for f in fs}
        if not on_sum or not free or out_fax != free or not free.keys() & partner_factors:
            continue
        partner_fax = _factor_axes(state.spec(partner), rule.operands[1 - pos], rule, sizes)
        if all(free.get(f) == axes for f, axes in partner_fax.items()):  # whole, or in the groups alike
            idle = {a for a, n in sizes.items() if n > 1} - {a for axes in free.values() for a in axes} - on_sum
            larger = math.prod(state.program.values[split].shape) > math.prod(state.program.values[out].shape)
            return None if larger and not idle else free
        held = {a for axes in partner_fax.values() for a in axes}
        if not (partner_fax.keys() & (summed | free.keys())) and on_sum <= held:
            return free  # the partner gathered whole, and s with it
    return None


def summed_whole_in_groups(op: Op, state) -> dict[int, Axes] | None:
    """The free factor -> axes XLA's dot partitioner groups ``op``'s devices by, where it gathers
    the operand split on the sum and runs the sum whole in each group (the case of
    :func:`grouped_sum_gathers`, whose estimate it is); None where it does not. A partner that
    holds axes of the groups' where the axes it leaves idle are a multiple of them is not gathered
    for the groups but moved into them (:func:`_grouping`); against it too the operand split on
    the sum over part of the idle axes alone is gathered and the sum run whole in the group:
    measured on jax 0.10.2, mesh 2x4, the key cotangent of a grouped-query attention (2 key heads
    on "model":(1)2, the rows on 'data') against the key projection's weight split on 'data'
    (either dim: ``fsdp_tp``): the cotangent gathered over 'model', the weight permuted and
    gathered, XLA's dot FLOPs 2x the estimate's where it all-reduced the result (the held-out
    Hugging Face Llama's and Mistral's ``fsdp_tp`` 0.94x).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> f = lambda w, x: jnp.einsum("il,jkl->ijk", w, x)
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((32, 32)), jnp.ones((8, 16, 32))), ["w", "x"], ["y"])
    >>> (w, x), (y,) = prog.inputs, prog.outputs
    >>> specs = {w: (("data",), ("model",)), x: ((), (), ()), y: (("data",), (), ())}
    >>> summed_whole_in_groups(prog.ops[0], ShardingState.initial(prog, {"data": 4, "model": 2}).replace(specs=specs))
    {0: ('data',)}
    """
    got = _grouping(op, state)
    if got is None:
        return None
    pos, free, moved = got
    rule, sizes = op.rule, state.axes
    split, out = op.linked_inputs[pos], op.linked_outputs[0]
    split_fax = _factor_axes(state.spec(split), rule.operands[pos], rule, sizes)
    on_sum = {a for f, axes in split_fax.items() if f in rule.reduction_factors for a in axes}
    grouped = {a for axes in free.values() for a in axes}
    if not on_sum:
        return None  # the sum whole
    out_fax = _factor_axes(state.spec(out), rule.results[0], rule, sizes)
    if out_fax != free:
        return _partner_split_over_the_group(op, state, pos, free, out_fax)
    idle = {a for a, n in sizes.items() if n > 1} - grouped - on_sum
    if moved and not idle:
        return None  # the partner split within the group against a sum over it all: not measured
    if not idle and math.prod(state.program.values[split].shape) > math.prod(state.program.values[out].shape):
        return None  # partial results summed, as the solution has it
    return free  # gathered: the result larger, or the sum split over part of the group alone


def _partner_split_over_the_group(op: Op, state, pos: int, free: dict[int, Axes],
                                  out_fax: dict[int, Axes]) -> dict[int, Axes] | None:
    """The result's factor -> axes where, in each group of :func:`summed_whole_in_groups`, the
    result splits the partner's free dims over every device of the group: the base case of XLA's
    dot partitioner finds the result's partner-side free dims split as many ways as the group has
    devices (``output_rhs_non_contracting_partitions == num_partitions``), reshards the partner to
    the result's layout and gathers the operand split on the sum whole in the group, the dot run
    in the result's layout; None otherwise. Measured on jax 0.10.2, mesh 2x4, a grouped-query key
    projection's input gradient ``bsk,hk->bsh`` (the key cotangent's rows on 'data', its 2 heads
    on "model":(1)2, the result on ("data", -, "model")), the weight whole or on 'data': the
    cotangent gathered over "model":(1)2, the weight sliced or permuted (the estimate summed
    partial results over "model":(1)2 and sliced: 2x XLA's dot FLOPs, 2.5x its bytes sent)."""
    rule, sizes = op.rule, state.axes
    extra = {f: axes for f, axes in out_fax.items() if f not in free}
    partner_free = {f for fs in rule.operands[1 - pos] for f in fs} - set(rule.reduction_factors)
    if any(out_fax.get(f) != axes for f, axes in free.items()) or not extra or not extra.keys() <= partner_free:
        return None
    grouped = {a for axes in free.values() for a in axes}
    in_group = math.prod(n for a, n in sizes.items() if n > 1 and a not in grouped)
    return out_fax if math.prod(sizes[a] for axes in extra.values() for a in axes) == in_group else None


def grouped_partner(op: Op, state) -> tuple[int, dict[int, Axes]] | None:
    """(the position of the operand, its free factor -> axes) of a dot one operand of which splits
    its own free dims (none its partner holds) as the result splits them, over axes G, its partner
    holding axes of G alone or nothing, so that the axes it leaves idle are no multiple of G: XLA's
    dot partitioner groups the devices by G and gathers the partner whole (over the axes it holds)
    for the groups (``GetNonContractingPartitionGroupedShardingForOtherOperand`` keeps a split
    there only where the idle axes are a multiple of G), a gather its reshard cache shares with the
    partner's other whole gathers; anything the partner is wanted split on within the group it
    slices. None for any other op.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> f = lambda dq, x: jnp.einsum("ijk,jkl->il", dq, x)  # a projection's weight gradient
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((32, 8, 16)), jnp.ones((8, 16, 32))), ["dq", "x"], ["dw"])
    >>> (dq, x), (dw,) = prog.inputs, prog.outputs
    >>> specs = {dq: (("data",), (), ()), x: ((), (), ("data",)), dw: (("data",), ("model",))}
    >>> state = ShardingState.initial(prog, {"data": 4, "model": 2}).replace(specs=specs)
    >>> grouped_partner(prog.ops[0], state)  # grouped by dq's rows on 'data': x gathered whole
    (0, {0: ('data',)})
    """
    got = _grouping(op, state)
    return None if got is None or got[2] else got[:2]


def _grouping(op: Op, state) -> tuple[int, dict[int, Axes], bool] | None:
    """(the position of the operand, its free factor -> axes, whether the partner keeps its split
    within the groups) of a dot grouped as :func:`grouped_partner` says, or, the partner holding
    axes of G where the axes it leaves idle are a multiple of G, one whose partner's split XLA
    moves onto those idle axes (a collective-permute) rather than gathering it: then True."""
    rule, sizes = op.rule, state.axes
    if op.primitive != "dot_general" or len(op.linked_inputs) != 2 or len(op.linked_outputs) != 1:
        return None
    summed = set(rule.reduction_factors)
    every = {a for a, n in sizes.items() if n > 1}
    out_fax = _factor_axes(state.spec(op.linked_outputs[0]), rule.results[0], rule, sizes)
    for pos in (0, 1):
        split_fax = _factor_axes(state.spec(op.linked_inputs[pos]), rule.operands[pos], rule, sizes)
        free = {f: axes for f, axes in split_fax.items() if f not in summed}
        partner_factors = {f for fs in rule.operands[1 - pos] for f in fs}
        if not free or free.keys() & partner_factors or any(out_fax.get(f) != axes for f, axes in free.items()):
            continue  # not grouped on free dims of its own that the result splits alike
        grouped = {a for axes in free.values() for a in axes}
        held = {a for axes in state.spec(op.linked_inputs[1 - pos]) for a in axes}
        idle = math.prod(sizes[a] for a in every - held)
        if held <= grouped:
            return pos, free, bool(held) and idle % math.prod(sizes[a] for a in grouped) == 0
    return None


def _factor_axes(spec, dims, rule, sizes) -> dict[int, Axes]:
    """factor -> axes of a value laid out as ``spec`` whose dims hold the factors ``dims``."""
    out: dict[int, Axes] = {}
    for axes, fs in zip(spec, dims, strict=True):
        if axes and fs:
            out.update(split_dim(axes, fs, rule, sizes))
    return out
