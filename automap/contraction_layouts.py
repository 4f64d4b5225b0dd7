"""How XLA's SPMD partitioner (jax 0.10.2, Shardy) runs a contraction (a dot or a convolution)
whose operands and result disagree, where that differs from the factor solution's way: the
operand gathered and the dot run in the result's layout, or the operands resharded to a result
split more ways or to one that would otherwise move an axis between its dims, sums split
differently in the two operands (:mod:`automap.mismatched_sums`), a whole partner gathered, a
detour over an idle mesh axis (or a sum moved onto it), a depthwise kernel gradient run over all
its channels. Each rule was measured on small functions compiled by XLA
(``tests/automap/cost/test_against_xla.py``); :func:`as_xla_contracts` applies them in turn for
:mod:`automap.analysis`.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Mapping, Sequence

from automap.factors import Axes, compose_spec, split_dim
from automap.ir.program import Op
from automap.idle_axis_detours import idle_axis_detours
from automap.mismatched_sums import mismatched_sums_in_result_layout
from automap.output_free_splits import free_splits_kept
from automap.whole_gathers import grouped_sum_gathers, whole_partner_gathers

CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})

Templates = tuple  # (linked position, kind, axes, bytes, where), as automap.analysis makes them
TemplatesOf = Callable[[Op, object, dict[int, Axes]], Templates]


def as_xla_contracts(op: Op, state, fax: dict[int, Axes], templates: Templates,
                     templates_of: TemplatesOf) -> tuple[dict[int, Axes], Templates, int]:
    """(factor axes, reshard templates, how many more ways the work is split) of a dot or a
    convolution as XLA's partitioner runs it, from the solution's ``fax`` and its reshards
    ``templates`` (``templates_of`` recomputes them for other factor axes)."""
    if op.primitive == "conv_general_dilated":
        if batch_groups_split_within(op, state):  # run whole: every operand gathered
            return {}, templates_of(op, state, {}), 1
        grouped = _batch_groups_kept_whole(op, state, fax, templates_of)
        if grouped is not None:  # measured: no detour over an idle axis then
            return (*grouped, 1)
        fax, templates = _free_dims_in_result_layout(op, state, fax, templates, templates_of)
        fax, templates = _moved_result_in_result_layout(op, state, fax, templates, templates_of)
        templates, detour = idle_axis_detours(op, state, fax, templates)
        return fax, templates, detour
    fax, templates = _result_layout_first(op, state, fax, templates, templates_of)
    fax, templates = _free_dims_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = _shared_sum_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = mismatched_sums_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = _moved_result_in_result_layout(op, state, fax, templates, templates_of)
    gathered = whole_partner_gathers(op, state, fax, templates_of) or grouped_sum_gathers(op, state, fax, templates_of)
    if gathered is not None:  # measured: no detour over an idle axis then
        return (*gathered, 1)
    templates, detour = idle_axis_detours(op, state, fax, templates)
    return fax, templates, detour


def _result_layout_first(op: Op, state, fax: dict[int, Axes], templates: Templates,
                         templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a contraction whose result is wanted whole on axes an operand
    splits a free dim on: XLA's dot partitioner all-gathers the operand and runs the dot in the
    result's layout, rather than gathering the result (measured on jax 0.10.2 with a result half
    the operand's size and with one 4x larger: the operand gathered both times, the llama's
    values pinned by a sharding constraint). Not where the result is a program output: its
    ``out_shardings`` do not pin the dot's own result, which XLA computes split as the operand
    is and gathers at the return (``bd,hd->bh``, ``w`` split on 'model', mesh 2x4, the output
    whole or on 'data': the result gathered, 4x the operand's bytes; a dense layer's input
    gradient, ``benchmarks/layout_matrix.py``: 2 rows brought within 10% on mesh 2x4, 3 on 4x2,
    and one row on each, matched before by errors that cancelled, 0.80x now: XLA gathers the
    weight for the forward dot and again for the input gradient, two replica-group forms its
    CSE does not merge, where the estimate shares one gather)."""
    gathered = {a for _, kind, axes, _, where, *_ in templates if kind == "all-gather" and where == "result" for a in axes}
    if not gathered:
        return fax, templates
    if any(v in _program_outputs(state.program) for v in op.linked_outputs):
        return _output_layout_unless_gathered(op, state, fax, templates, templates_of)
    alt = {f: kept for f, axes in fax.items() if (kept := tuple(a for a in axes if a not in gathered))}
    return alt, templates_of(op, state, alt)


def _output_layout_unless_gathered(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                   templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a dot making a program output that the solution's layout
    reaches only by a gather: XLA gathers the result where the output keeps, on each dim, a
    major part of the axes the dot's layout gives it (what :func:`_result_layout_first` leaves
    alone); where the output wants a dim on other axes (``bd,hd->bh``, ``w``'s rows on 'model',
    the output's columns on 'data'; a dense layer's weight gradient ``bsd,bsh->dh`` and input
    gradient, the activation on 'data' and the output on 'model', or its weight's rows on
    ('data', 'model') and the output on 'model'), it runs the dot in the output's layout, the
    operand resharded to it (measured on jax 0.10.2, meshes 2x4 and 4x2, the other operand whole:
    the estimate gathered the result, 3x XLA's bytes sent, 2x its dot FLOPs). Where the dot sums
    partial results, as before."""
    rule, sizes = op.rule, state.axes
    if op.primitive != "dot_general" or len(op.linked_outputs) != 1 or any(fax.get(f) for f in rule.reduction_factors):
        return fax, templates
    wanted = state.spec(op.linked_outputs[0])
    implied = compose_spec(rule.results[0], fax, rule, sizes)
    if all(tuple(have[: len(want)]) == tuple(want) for have, want in zip(implied, wanted, strict=True)):
        return fax, templates  # a major part kept on every dim: the result gathered
    alt = _factor_axes(wanted, rule.results[0], rule, sizes)
    return alt, templates_of(op, state, alt)


def _program_outputs(program) -> frozenset[int]:
    """The program's outputs as a set (memoised on the program)."""
    got = program.memo.get("output_set")
    if got is None:
        got = program.memo["output_set"] = frozenset(program.outputs)
    return got


def _free_dims_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a contraction whose sum no operand splits, its result split on
    axes the factor solution leaves off its dims (an operand split otherwise on a free dim
    disagreed): XLA's dot partitioner runs the dot in the result's layout, the operands resharded
    to it, rather than computing a less split result and slicing it. Measured on jax 0.10.2, mesh
    2x4, ``bsi,bso->io`` (a dense layer's weight gradient, FSDP's input and cotangent both split
    on their features over 'data', the gradient on (model, data) or (data, model)): the dot split
    8 ways, one operand moved by a collective-permute; the estimate split it 2 ways (a ViT's
    weight gradients under FSDP: 1.43x XLA's dot FLOPs); a ResNet stem's ungrouped conv too (its
    kernel's features on 'data', the result's on 'model': the kernel permuted, split 8 ways, not
    2). Where the solution's layout is not a part of the result's (an axis on another factor), or
    the dot sums partial results, as before."""
    if len(op.linked_outputs) != 1 or op.params.get("feature_group_count", 1) * op.params.get("batch_group_count", 1) > 1:
        return fax, templates  # XLA runs a grouped conv in its groups' layout
    rule, sizes = op.rule, state.axes
    if any(fax.get(f) for f in rule.reduction_factors):
        return fax, templates
    alt = _factor_axes(state.spec(op.linked_outputs[0]), rule.results[0], rule, sizes)
    if math.prod(sizes[a] for axes in alt.values() for a in axes) <= math.prod(sizes[a] for axes in fax.values() for a in axes):
        return fax, templates
    return alt, templates_of(op, state, alt)


def _shared_sum_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                 templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a dot whose two operands split the dims it sums over alike (the
    same axes in both) and whose result is split: XLA's dot partitioner sums partial results over
    those axes and runs the free dims in the result's layout less the summed axes (each result
    dim's axes up to the first summed one: a tile the partial result can hold), the operands
    resharded to it, the reduced result sliced into place; where a dim's tile is cut short so and
    an operand splits a free dim over an axis that layout gives another factor, the free dims all
    run whole; some free splits the result does not want are kept
    (:mod:`automap.output_free_splits`). Measured on jax 0.10.2, mesh 2x4, ``bsd,bsh->dh`` (a dense
    layer's weight gradient; 20 layouts): both batches on 'data', ``bsh``'s features on 'model',
    the result on ``h`` over ('model', 'data'): computed on 'model', reduced over 'data' (the
    estimate gathered ``bsd``: 5x XLA's bytes); over ('data', 'model'), or the result ('model',
    'data') or (('data', 'model'), -): ``bsh`` gathered over 'model' and the result (its rows on
    'model') reduced whole (the estimate reduced a 'model' piece and sliced it: 0.12-0.18x XLA's
    bytes); both batches on 'model', the result's rows on ('data', 'model'): computed on 'data'
    where ``bsd`` splits its rows so, whole where ``bsh`` splits its features on 'data' too. A
    whole result is left to the rules before (XLA keeps the larger operand's free split there)."""
    rule, sizes = op.rule, state.axes
    shared = shared_sums(op, state)
    if shared is None:
        return fax, templates
    sums, free = shared
    result = state.spec(op.linked_outputs[0])
    if not any(result):
        return fax, templates  # a whole result: not this way (XLA gathers the smaller operand)
    summed = {a for axes in sums.values() for a in axes}
    tiles = tuple(tuple(itertools.takewhile(lambda a: a not in summed, axes)) for axes in result)
    truncated = any(0 < len(kept) < len(axes) for kept, axes in zip(tiles, result, strict=True))
    alt = {**sums, **_factor_axes(tiles, rule.results[0], rule, sizes)}
    if truncated and any(set(axes) & {a for g, got in alt.items() if g != f for a in got}
                         for split in free for f, axes in split.items()):
        alt, alt_templates = dict(sums), None  # a tile cut short that a free split contends for: computed whole
    else:
        alt, alt_templates = free_splits_kept(op, state, free, alt, templates_of)
    if alt == fax:
        return fax, templates
    return alt, alt_templates if alt_templates is not None else templates_of(op, state, alt)


def shared_sums(op: Op, state) -> tuple[dict[int, Axes], list[dict[int, Axes]]] | None:
    """(summed factor -> axes, each operand's free factor -> axes) of a dot whose two operands
    split the dims it sums over alike (the same axes in both); None for any other op.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> f = lambda x, dy: jnp.einsum("bsd,bsh->dh", x, dy)  # a dense layer's weight gradient
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((8, 4, 16)), jnp.ones((8, 4, 32))), ["x", "dy"], ["dw"])
    >>> (x, dy), dot = prog.inputs, prog.ops[0]
    >>> specs = {x: (("data",), (), ()), dy: (("data",), (), ("model",))}
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4}).replace(specs=specs)
    >>> shared_sums(dot, state)  # b (factor 0) on 'data' in both; dy's h (factor 3) on 'model'
    ({0: ('data',)}, [{}, {3: ('model',)}])
    >>> print(shared_sums(dot, state.replace(specs={**specs, dy: ((), (), ("model",))})))  # dy's b whole
    None
    """
    rule, sizes = op.rule, state.axes
    if op.primitive != "dot_general" or len(op.linked_inputs) != 2 or len(op.linked_outputs) != 1:
        return None
    splits, free = [], []
    for vid, dims in zip(op.linked_inputs, rule.operands, strict=True):
        split = _factor_axes(state.spec(vid), dims, rule, sizes)
        splits.append({f: split[f] for f in rule.reduction_factors if f in split})
        free.append({f: axes for f, axes in split.items() if f not in rule.reduction_factors})
    if not splits[0] or splits[1] != splits[0]:
        return None
    return splits[0], free


def _factor_axes(spec: Sequence[Axes], dims: Sequence, rule, sizes: Mapping[str, int]) -> dict[int, Axes]:
    """factor -> axes of a value laid out as ``spec`` whose dims hold the factors ``dims`` (each
    dim's axes given to its factors major to minor: :func:`automap.factors.split_dim`)."""
    out: dict[int, Axes] = {}
    for axes, fs in zip(spec, dims, strict=True):
        if axes and fs:
            out.update(split_dim(axes, fs, rule, sizes))
    return out


def _moved_result_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                   templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a contraction whose result, as the solution computes it, would
    move an axis between its dims (an all-to-all): XLA's dot partitioner (convolutions too) runs
    it in the result's layout instead, each free dim on the result's axes (less those its sum is
    split on), the sum split as before, the operand split otherwise resharded and the partial
    result reduce-scattered into place. Measured on jax 0.10.2, meshes 4x2 and 2x4, ``bi,bo->io``
    and a 3x3 kernel gradient (the batch on 'data' and the features on 'model' in both operands,
    the result's ``i`` on 'data' and ``o`` on 'model'), the operands 1/64 to 64x each other and
    up to 64x the result: the operand split on ``i`` gathered, a reduce-scatter over 'data'; the
    estimate computed ``i`` on 'model', all-reduced the result and moved it (a ResNet's FSDP
    plan on 4x2: 1.23x XLA's bytes sent). Where no operand splits the sum: the same where the
    solution splits only batches both operands hold (:func:`_shared_batch_moved`), else as
    before (a GShard MoE's dispatch into experts: XLA moves the result by all-to-all); where the
    result's layout still needs a move or a gather, and for grouped convolutions (XLA partitions
    them by their groups), as before."""
    if len(op.linked_outputs) != 1 or not (any(t[1] == "all-to-all" and t[4] == "result" for t in templates)
                                           or _conv_result_split_anew(op, state, fax)):
        return fax, templates
    if op.params.get("feature_group_count", 1) != 1 or op.params.get("batch_group_count", 1) != 1:
        return fax, templates
    rule, sizes = op.rule, state.axes
    summed = set(rule.reduction_factors)
    alt = {f: axes for f, axes in fax.items() if f in summed and axes}
    if not alt and not _shared_batch_moved(op, state, fax):
        return fax, templates  # the sum whole, not a shared batch moved: XLA moves the result
    used = {a for axes in alt.values() for a in axes}
    free = tuple(tuple(a for a in axes if a not in used) for axes in state.spec(op.linked_outputs[0]))
    alt.update(_factor_axes(free, rule.results[0], rule, sizes))
    other = templates_of(op, state, alt)
    if any(t[1] in ("all-to-all", "all-gather") and t[4] == "result" for t in other):
        return fax, templates
    return alt, other


def _shared_batch_moved(op: Op, state, fax: dict[int, Axes]) -> bool:
    """Whether a dot's solution splits only batch factors (dims both operands and the result
    hold), the sum whole, and the result keeps those batches whole: its result moved between dims,
    XLA's dot partitioner runs the dot in the result's layout, the operand holding the result's
    split dim moved to it by an all-to-all and the other gathered, whatever their sizes. Measured
    on jax 0.10.2, mesh 2x4,
    ``estnd,esth->endh`` (the weight gradient of a vmapped ensemble's attention projection: both
    operands' members on 'model', the gradient's heads or features on 'model'),
    ``esth,ehnd->estnd`` and ``gsec,gsd->egcd`` alike (the members on 'data' too): an all-gather
    of 8 to 64 KiB and an all-to-all, where the estimate moved a 4 KiB result (a held-out nnx
    ensemble's megatron_dp plan: 0.79x XLA's bytes sent). Where the result keeps a batch split
    (GShard's dispatch, the groups on ('data', 'model'), the experts on 'model'), XLA moves the
    result by all-to-all (``tests/tactics/test_expert_parallel.py``)."""
    rule = op.rule
    split = [f for f, axes in fax.items() if axes]
    if op.primitive != "dot_general" or len(rule.operands) != 2 or len(op.linked_outputs) != 1 or not split:
        return False
    held = [{f for fs in dims for f in fs} for dims in rule.operands]
    kept = _factor_axes(state.spec(op.linked_outputs[0]), rule.results[0], rule, state.axes)
    return all(f in held[0] and f in held[1] and not kept.get(f) for f in split)


def _conv_result_split_anew(op: Op, state, fax: dict[int, Axes]) -> bool:
    """Whether a convolution's result, as the solution computes it, holds axes on a dim it wants
    split on others: XLA runs it in the result's layout, as a result moved between dims (a dot's
    result it gathers and slices). Measured on jax 0.10.2, mesh 2x4, a ResNet stem's kernel
    gradient under FSDP (the batch on 'data', the cotangent's features on 'model', the gradient's
    on 'data'): the cotangent gathered, the kernel reduce-scattered, 3,936 B, the estimate 540."""
    if op.primitive != "conv_general_dilated":
        return False
    rule = op.rule
    have = compose_spec(rule.results[0], fax, rule, state.axes)
    return any(h and w and tuple(w[: len(h)]) != tuple(h) and tuple(h[: len(w)]) != tuple(w)
               for h, w in zip(have, state.spec(op.linked_outputs[0]), strict=True))


def batch_groups_split_within(op: Op, state) -> bool:
    """Whether ``op`` is a batch-grouped convolution (a grouped conv's kernel gradient) whose lhs
    splits its batch dim (the groups, then the channels within a group) more ways than its groups
    divide into: XLA's partitioner gathers every operand whole and runs it whole, its result
    sliced, and shares those gathers with the value's other whole gathers (CSE; no
    :func:`automap.gather_reuse.gathered_apart` exception). Measured on jax 0.10.2, mesh 2x4, a
    3x3 kernel gradient over 16 channels in 2 groups (the lhs on 'model' or ('data', 'model'),
    the examples whole or on 'data', the cotangent and the result whole or on 'data'; 4 groups:
    ('data', 'model')): 589,824 FLOPs (2 groups) where the estimate split the groups on 'data'
    (147,456, its lhs moved from 'model'; a held-out RegNet's fsdp plan 0.89x XLA's dot FLOPs).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
    ...                                                  feature_group_count=2)
    >>> dw = lambda x, w: jax.grad(lambda w: conv(x, w).sum())(w)  # a 2-group kernel gradient over 8 channels
    >>> prog = lower(jax.make_jaxpr(dw)(jnp.ones((4, 6, 8)), jnp.ones((3, 4, 8))), ["x", "w"], ["dw"])
    >>> op = next(op for op in prog.ops if op.params.get("batch_group_count", 1) > 1)
    >>> state = ShardingState.initial(prog, {"data": 2, "model": 4})
    >>> on = lambda axis: state.replace(specs={**state.specs, op.linked_inputs[0]: ((), (), (axis,))})
    >>> batch_groups_split_within(op, on("data")), batch_groups_split_within(op, on("model"))  # 4 ways past 2 groups
    (False, True)
    """
    numbers = op.params.get("dimension_numbers")
    groups = op.params.get("batch_group_count", 1)
    if groups == 1 or numbers is None or not op.rule.operands or not op.rule.operands[0][numbers[0][0]]:
        return False
    return groups % math.prod(state.axes[a] for a in state.spec(op.linked_inputs[0])[numbers[0][0]]) != 0


def _batch_groups_kept_whole(op: Op, state, fax: dict[int, Axes], templates_of: TemplatesOf) -> tuple[dict, Templates] | None:
    """(factor axes, templates) of a batch-grouped convolution (a depthwise conv's kernel
    gradient) whose lhs keeps its groups (the channels) whole and whose solution splits the sum
    (the examples), as XLA's partitioner runs it: over every group whatever the result's layout,
    the sum split as the solution splits it, the partial result reduced over every mesh axis (the
    ones the examples leave idle too): reduce-scattered where the result splits its groups over
    all of them in mesh order, else all-reduced whole (then sliced). Measured on jax 0.10.2, mesh
    2x4, a 7x7 kernel gradient over 32 channels, the examples on 'data' or ('data', 'model'), the
    result whole or on 'data', 'model' or ('data', 'model'): 8 layouts, the FLOPs and collectives
    exact (the estimate split the channels as the result does and summed over 'data' alone: a
    held-out nnx ConvNeXt's fsdp_tp plan 0.59x XLA's dot FLOPs). None where it does not apply."""
    numbers = op.params.get("dimension_numbers")
    rule, sizes = op.rule, state.axes
    if op.params.get("batch_group_count", 1) == 1 or numbers is None or len(op.linked_outputs) != 1 or not rule.operands:
        return None
    lhs_batch = numbers[0][0]
    if not rule.operands[0][lhs_batch] or state.spec(op.linked_inputs[0])[lhs_batch]:
        return None  # no group factor, or the lhs splits its groups
    alt = {f: axes for f, axes in fax.items() if f in rule.reduction_factors and axes}
    if not alt:
        return None  # the sum whole: not measured
    every = tuple(a for a, n in sizes.items() if n > 1)
    alt = sum_over_every_axis(rule, alt, every, sizes)
    if not alt:  # the sum cannot be split over every axis: run whole (automap.grouped_conv_guard)
        return {}, templates_of(op, state, {})
    out = op.linked_outputs[0]
    held = tuple(a for axes in state.spec(out) for a in axes)
    kind = "reduce-scatter" if held == every else "all-reduce"
    operands = tuple(t for t in templates_of(op, state, alt) if t[4] == "operand")
    return alt, operands + ((len(op.linked_inputs), kind, every, state.program.values[out].nbytes, "result"),)


def sum_over_every_axis(rule, alt: dict[int, Axes], every: tuple[str, ...], sizes) -> dict[int, Axes]:
    """The sum factors ``alt`` of a batch-grouped conv whose groups run whole, split over
    ``every`` mesh axis: XLA (jax 0.10.2) all-reduces such a conv's partial result over every
    device, so a sum split on some axes alone comes out times the idle axes' size
    (``benchmarks/grouped_conv_numbers.py``: the kernel gradient 4x with the examples on 'data' of
    mesh 2x4, 2x on 'model'; right on both, in either order). The idle axes go after those of the
    first sum factor they divide (a slice of each device's piece: nothing sent); ``{}`` (the conv
    run whole) where none does.

    >>> from automap.rules.registry import Factor, FactorRule
    >>> rule = FactorRule(factors=(Factor(8, "reduction"), Factor(3, "reduction")), operands=(), results=())
    >>> sum_over_every_axis(rule, {0: ("model",)}, ("data", "model"), {"data": 2, "model": 4})
    {0: ('model', 'data')}
    >>> sum_over_every_axis(rule, {1: ("data",)}, ("data", "model"), {"data": 2, "model": 4})
    {}
    """
    held = {a for axes in alt.values() for a in axes}
    idle = tuple(a for a in every if a not in held)
    if not idle:
        return alt
    for f in alt:
        axes = (*alt[f], *idle)
        if rule.factors[f].size % math.prod(sizes[a] for a in axes) == 0:
            return {**alt, f: axes}
    return {}
