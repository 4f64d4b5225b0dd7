"""How XLA's SPMD partitioner (jax 0.10.2, Shardy) runs a contraction (a dot or a convolution)
whose operands and result disagree, where that differs from the factor solution's way: the
operand gathered and the dot run in the result's layout, or the operands resharded to a result
split more ways or to one that would otherwise move an axis between its dims, sums split
differently in the two operands, a whole partner gathered, a detour over an idle mesh axis (or
a sum moved onto it), a depthwise kernel gradient run over all its channels. Each rule was
measured on small functions compiled by XLA (``tests/automap/cost/test_against_xla.py``);
:func:`as_xla_contracts` applies them in turn for :mod:`automap.analysis`.
"""
from __future__ import annotations

import itertools
import math
from typing import Callable, Mapping, Sequence

from automap.factors import Axes, compose_dim, split_dim
from automap.ir.program import Op

CONTRACTIONS = frozenset({"dot_general", "conv_general_dilated"})

Templates = tuple  # (linked position, kind, axes, bytes, where), as automap.analysis makes them
TemplatesOf = Callable[[Op, object, dict[int, Axes]], Templates]


def as_xla_contracts(op: Op, state, fax: dict[int, Axes], templates: Templates,
                     templates_of: TemplatesOf) -> tuple[dict[int, Axes], Templates, int]:
    """(factor axes, reshard templates, how many more ways the work is split) of a dot or a
    convolution as XLA's partitioner runs it, from the solution's ``fax`` and its reshards
    ``templates`` (``templates_of`` recomputes them for other factor axes)."""
    if op.primitive == "conv_general_dilated":
        grouped = _batch_groups_kept_whole(op, state, fax, templates_of)
        if grouped is not None:  # measured: no detour over an idle axis then
            return (*grouped, 1)
        fax, templates = _moved_result_in_result_layout(op, state, fax, templates, templates_of)
        templates, detour = _idle_axis_detours(op, state, fax, templates)
        return fax, templates, detour
    fax, templates = _result_layout_first(op, state, fax, templates, templates_of)
    fax, templates = _free_dims_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = _shared_sum_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = _mismatched_sums_in_result_layout(op, state, fax, templates, templates_of)
    fax, templates = _moved_result_in_result_layout(op, state, fax, templates, templates_of)
    gathered = _whole_partner_gathers(op, state, fax, templates_of)
    if gathered is not None:  # measured: no detour over an idle axis then
        return (*gathered, 1)
    templates, detour = _idle_axis_detours(op, state, fax, templates)
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
    if not gathered or any(v in _program_outputs(state.program) for v in op.linked_outputs):
        return fax, templates
    alt = {f: kept for f, axes in fax.items() if (kept := tuple(a for a in axes if a not in gathered))}
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
    weight gradients under FSDP: 1.43x XLA's dot FLOPs). Where the solution's layout is not a
    part of the result's (an axis on another factor), or the dot sums partial results, as before."""
    if op.primitive != "dot_general" or len(op.linked_outputs) != 1:
        return fax, templates
    rule, sizes = op.rule, state.axes
    if any(fax.get(f) for f in rule.reduction_factors):
        return fax, templates
    alt = _factor_axes(state.spec(op.linked_outputs[0]), rule.results[0], rule, sizes)
    if math.prod(sizes[a] for axes in alt.values() for a in axes) <= math.prod(sizes[a] for axes in fax.values() for a in axes):
        return fax, templates
    return alt, templates_of(op, state, alt)


def _shared_sum_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                 templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a dot whose two operands split the dims it sums over alike
    (the same axes in both) and whose result is split: XLA's dot partitioner sums partial results
    over those axes and runs the free dims in the result's layout less the summed axes (each
    result dim's axes up to the first summed one: a tile the partial result can hold), the
    operands resharded to it, the reduced result sliced into place; where a dim's tile is cut
    short so and an operand splits a free dim over an axis that layout gives another factor, the
    free dims all run whole. Measured on jax 0.10.2, mesh 2x4, ``bsd,bsh->dh`` (a dense layer's
    weight gradient; 20 layouts): both batches on 'data', ``bsh``'s features on 'model', the
    result on ``h`` over ('model', 'data'): computed on 'model', reduced over 'data' (the estimate
    gathered ``bsd``: 5x XLA's bytes); over ('data', 'model'), or the result ('model', 'data') or
    (('data', 'model'), -): ``bsh`` gathered over 'model' and the result (its rows on 'model')
    reduced whole (the estimate reduced a 'model' piece and sliced it: 0.12-0.18x XLA's bytes);
    both batches on 'model', the result's rows on ('data', 'model'): computed on 'data' where
    ``bsd`` splits its rows so, whole where ``bsh`` splits its features on 'data' too. A whole
    result is left to the rules before (XLA keeps the larger operand's free split there)."""
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
        alt = dict(sums)  # a tile cut short that an operand's free split contends for: the result computed whole
    if alt == fax:
        return fax, templates
    return alt, templates_of(op, state, alt)


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
    plan on 4x2: 1.23x XLA's bytes sent). Where no operand splits the sum (a GShard MoE's
    dispatch into experts: XLA moves the result by all-to-all), where the result's layout still
    needs a move or a gather, and for grouped convolutions (XLA partitions them by their
    groups), as before."""
    if len(op.linked_outputs) != 1 or not any(t[1] == "all-to-all" and t[4] == "result" for t in templates):
        return fax, templates
    if op.params.get("feature_group_count", 1) != 1 or op.params.get("batch_group_count", 1) != 1:
        return fax, templates
    rule, sizes = op.rule, state.axes
    summed = set(rule.reduction_factors)
    alt = {f: axes for f, axes in fax.items() if f in summed and axes}
    if not alt:  # the sum whole (GShard's dispatch into experts): XLA moves the result
        return fax, templates
    used = {a for axes in alt.values() for a in axes}
    free = tuple(tuple(a for a in axes if a not in used) for axes in state.spec(op.linked_outputs[0]))
    alt.update(_factor_axes(free, rule.results[0], rule, sizes))
    other = templates_of(op, state, alt)
    if any(t[1] in ("all-to-all", "all-gather") and t[4] == "result" for t in other):
        return fax, templates
    return alt, other


def _mismatched_sums_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
                                      templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a contraction whose two operands both split the dims it sums
    over, no summed dim on the same axes in both (one 8 ways over ('data', 'model'), the other 2
    ways over 'data'), its result split: XLA's dot partitioner finds no partial sum both operands
    share and runs the dot in the result's layout, each operand resharded to the result's splits
    of its free dims: moved there by an all-to-all where all its axes move, else, split along the
    sum alone, gathered whole (then sliced), rather than summing partial results and resharding
    the result. Measured on jax 0.10.2, mesh 2x4, ``bi,bj->ij`` (the weight gradient of a dense
    layer whose input and cotangent FSDP left split differently): the result (model, data) with
    the input on its batch (data) or its batch and features (model, data) or (data, model), the
    batch 8 or 512 (operands 10x the result: resharded all the same); ``bsk,bsn->kn`` with the
    sequence of one and the batch of the other 8 ways, the result on ``k``: ``bsk`` moved, ``bsn``
    gathered, the one twice the other's size or half of it (an MLP-Mixer's weight gradients under
    FSDP). The same where one operand alone splits the sum and the other only free dims the
    result leaves whole (:func:`_sum_moves_to_the_result`). A mesh axis the result leaves free
    splits the sum as an operand splits it (an attention input projection, its weight (features
    on 'data', inputs on 'model'), the activation's inputs on 'data', the result's features on
    'data': summed over 'model', the activation resharded to it). Where one summed dim is split
    alike in both (a ViT's attention output projection, the heads on 'model' in both, the head
    dim on 'data' in one), XLA sums partial results over it as before; a replicated result too
    (XLA gathers the operand split more ways down to the other's split)."""
    rule = op.rule
    summed = set(rule.reduction_factors)
    if not summed or len(op.linked_inputs) != 2 or len(op.linked_outputs) != 1:
        return fax, templates

    def summed_axes(pos: int) -> dict[int, Axes] | None:
        out = {}
        for axes, fs in zip(state.spec(op.linked_inputs[pos]), rule.operands[pos], strict=True):
            if fs and set(fs) <= summed and axes:
                if len(fs) != 1:
                    return None  # a merged dim: not measured
                out[fs[0]] = axes
        return out

    split = [summed_axes(0), summed_axes(1)]
    result = state.spec(op.linked_outputs[0])
    if split[0] is None or split[1] is None or not any(result):
        return fax, templates
    if any(split[0].get(f) == axes for f, axes in split[1].items()):
        return fax, templates  # a partial sum both operands share: XLA sums over it
    if not (split[0] and split[1]) and not _sum_moves_to_the_result(op, state, split, result):
        return fax, templates
    alt: dict[int, Axes] = {}
    for axes, fs in zip(result, rule.results[0], strict=True):
        if axes and len(fs) != 1:
            return fax, templates  # a merged dim: not measured
        if axes:
            alt[fs[0]] = axes
    used = {a for axes in alt.values() for a in axes}
    for f in summed:  # the axes the result leaves free split the sum as an operand splits it
        kept = [tuple(a for a in got.get(f, ()) if a not in used) for got in split]
        if best := max(kept, key=len):
            alt[f] = best
            used.update(best)
    templates = templates_of(op, state, alt)
    if summed & set(alt):
        return alt, templates
    out = list(templates)
    for pos, vid in enumerate(op.linked_inputs):  # split along the sum alone and not moved whole: gathered whole
        held = {a for axes in state.spec(vid) for a in axes}
        mine = {t[1] for t in templates if t[0] == pos}
        if held == {a for axes in split[pos].values() for a in axes} and mine == {"all-gather", "all-to-all"}:
            whole = (pos, "all-gather", tuple(a for a in state.axes if a in held), state.program.values[vid].nbytes, "operand")
            out = [t for t in out if t[0] != pos] + [whole]
    return alt, tuple(out)


def _sum_moves_to_the_result(op: Op, state, split: list[dict[int, Axes]], result) -> bool:
    """Whether one operand splits the sum alone, on the axes the result splits the operand's free
    dims on, and the other splits only free dims the result leaves whole (``bsk,bsn->kn``, the
    batch of ``bsn`` and the features of ``bsk`` over ('data', 'model'), the result's ``n`` over
    them): no split the operands or the result share, so XLA's dot partitioner, as its last
    resort, runs the dot in the result's layout: that operand's axes moved to its free dims (an
    all-to-all), the other gathered whole, whatever their sizes (measured on jax 0.10.2, mesh 2x4,
    the gathered operand half and twice the other's size; ``bsk,bsn->bkn`` with ``bsk`` split on
    its batch over ('data', 'model') or 'data' alone: gathered whole all the same)."""
    rule = op.rule
    summed = set(rule.reduction_factors)
    moved = [pos for pos in (0, 1) if split[pos]]
    if len(moved) != 1:
        return False
    pos = moved[0]
    held = [{a for axes in state.spec(v) for a in axes} for v in op.linked_inputs]
    if held[pos] != {a for axes in split[pos].values() for a in axes}:
        return False
    free = [{f for fs in dims for f in fs} - summed for dims in rule.operands]
    result_split = {f for axes, fs in zip(result, rule.results[0], strict=True) if axes for f in fs}
    if not result_split <= free[pos] - free[1 - pos] or {a for axes in result for a in axes} != held[pos]:
        return False
    other = op.linked_inputs[1 - pos]
    return bool(held[1 - pos]) and all(not axes or set(fs) <= free[1 - pos] - result_split
                                      for axes, fs in zip(state.spec(other), rule.operands[1 - pos], strict=True))


def _whole_partner_gathers(op: Op, state, fax: dict[int, Axes], templates_of: TemplatesOf) -> tuple[dict, Templates] | None:
    """(factor axes, templates) of a contraction whose summed dims one operand splits while the
    other operand is whole on every mesh axis, as XLA's dot partitioner runs it: the split operand
    all-gathered and the dot run whole on those axes, rather than partial results summed; no
    detour over an idle axis; a result wanted split over the gathered axes on a dim of the whole
    operand computed so (the whole operand sliced). Measured on jax 0.10.2: ``ecd,tec->td`` and
    ``mk,kn->mn`` with the split operand 0.6x to 32x the result, over 'model' and over 'data'
    ('model' idle), the result whole or split on a dim of the whole operand (the routed tokens of
    a Switch MoE whose batch stays whole). None where it does not apply: the other operand split
    on some axis, the split operand split on a dim it keeps too (``exp(x) @ w``, its rows on 'data'
    and its features on 'model': XLA all-reduces the partial result over 'model'), or the result
    wanting the gathered axes on a dim of the split operand (XLA does otherwise there)."""
    rule = op.rule
    summed = {a for f in rule.reduction_factors for a in fax.get(f, ())}
    if not summed or len(op.linked_inputs) != 2:
        return None
    whole = [i for i, v in enumerate(op.linked_inputs) if not any(state.spec(v))]
    if len(whole) != 1:
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
    out = op.linked_outputs[0]
    held = tuple(a for axes in state.spec(out) for a in axes)
    kind = "reduce-scatter" if held == every else "all-reduce"
    operands = tuple(t for t in templates_of(op, state, alt) if t[4] == "operand")
    return alt, operands + ((len(op.linked_inputs), kind, every, state.program.values[out].nbytes, "result"),)


def _idle_axis_detours(op: Op, state, fax: dict[int, Axes], templates: Templates) -> tuple[Templates, int]:
    """(templates, how many more ways the op's work is split) as XLA's dot partitioner (jax 0.10.2)
    runs a contraction that leaves a mesh axis idle (no factor, operand or result of it on the
    axis) at least as large as the group of a reshard it needs: it splits the dot over the idle
    axis too and moves the pieces into place with a collective-permute. An operand all-gather over
    ``A`` (S bytes gathered) becomes a collective-permute of S/m over ``A`` and the idle axis (m
    devices) and an all-gather over the idle axis; a result reduce-scatter over ``A`` (n devices,
    S bytes) an all-reduce over ``A`` of S/n and a collective-permute of S/n, the dot's work split n
    more ways. Twice the bytes the plain collective sends, on every dot measured (mesh 2x4 and
    2x2, batched and plain, FSDP's weight gathers and gradient scatters with 'model' idle), and on
    convolutions, which XLA partitions as dots (a kernel gathered for the forward conv, its
    gradient scattered, mesh 2x4: the resnet's fsdp_tp plan); an idle axis smaller than the group
    leaves the plain collective. An operand gathered along a summed dim whose result is smaller
    than it (the result's bytes per device in its layout ``R`` below the gathered operand's ``S``)
    is instead permuted so that the idle axis splits the sum, and the partial results all-reduced
    over it, the work split m more ways (measured: a conv whose kernel is split on its input
    features with a 2 KiB result, and with an 8 KiB result against a 12 KiB kernel (a held-out
    haiku Conv1D under fsdp_tp); ``x @ w`` with ``w`` split on its rows, 4 KiB and 64 KiB,
    results from 512 B up to 3,840 and 63,488 B: summed; at ``R == S`` and above XLA gathers, as
    it gathers the 9 KiB kernel of a 64 KiB result; the rule was ``2 R < S`` before, 4x XLA's dot
    FLOPs between). Other contractions (a ragged dot is a masked dense dot on CPU) are left as they
    are: not measured."""
    if not templates or op.primitive not in ("dot_general", "conv_general_dilated"):  # measured on these alone
        return templates, 1
    sizes = state.axes
    used = {a for axes in fax.values() for a in axes}
    used.update(a for v in op.linked for axes in state.spec(v) for a in axes)
    idle = [a for a, n in sizes.items() if n > 1 and a not in used]
    if not idle:
        return templates, 1
    out, split = [], 1
    for pos, kind, axes, nbytes, where, *_ in templates:
        n = math.prod(sizes[a] for a in axes)
        spare = next((a for a in idle if sizes[a] >= n), None)
        if spare is None or (kind, where) not in (("all-gather", "operand"), ("reduce-scatter", "result")):
            out.append((pos, kind, axes, nbytes, where))
            continue
        both = tuple(a for a in sizes if a in axes or a == spare)
        m = sizes[spare]
        partial = _summed_partial_bytes(op, state, fax, pos, axes) if kind == "all-gather" else None
        if partial is not None and partial < nbytes:  # a result smaller than the gathered operand: summed over the idle axis
            out += [(pos, "collective-permute", both, nbytes // m, where),
                    (len(op.linked_inputs), "all-reduce", (spare,), partial, "result")]
            split *= m
        elif kind == "all-gather":
            out += [(pos, "collective-permute", both, nbytes // m, where),
                    (pos, "all-gather", (spare,), nbytes, where)]
        else:
            out += [(pos, "all-reduce", axes, nbytes // n, where), (pos, "collective-permute", both, nbytes // n, where)]
            split *= n
    return tuple(out), split


def _summed_partial_bytes(op: Op, state, fax: dict[int, Axes], pos: int, axes: Axes) -> int | None:
    """Bytes per device of the op's (first) result in its layout, where its operand ``pos`` is
    gathered over ``axes`` along a dim the op sums over (else None)."""
    rule, sizes = op.rule, state.axes
    summed = set(rule.reduction_factors)
    spec, dims = state.spec(op.linked_inputs[pos]), rule.operands[pos]
    if not op.linked_outputs or not any(set(a) & set(axes) and fs and set(fs) <= summed
                                        for a, fs in zip(spec, dims, strict=True)):
        return None
    implied = tuple(compose_dim(fs, fax, rule, sizes) if fs else () for fs in rule.results[0])
    return state.program.values[op.linked_outputs[0]].nbytes // math.prod(sizes[a] for axes in implied for a in axes)
