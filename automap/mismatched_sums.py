"""A contraction whose two operands split the dims it sums over differently (no summed dim on the
same axes in both), or one operand the sum and the other only free dims the result leaves whole:
XLA's dot partitioner finds no partial sum to share and runs the dot in the result's layout, or
gathers both operands whole. A rule of :func:`automap.contraction_layouts.as_xla_contracts`."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from automap.factors import Axes
from automap.ir.program import Op
from automap.reshard_bytes import moved_bytes

if TYPE_CHECKING:
    from automap.contraction_layouts import Templates, TemplatesOf


def mismatched_sums_in_result_layout(op: Op, state, fax: dict[int, Axes], templates: Templates,
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
    if split[0] is None or split[1] is None:
        return fax, templates
    if any(split[0].get(f) == axes for f, axes in split[1].items()):
        return fax, templates  # a partial sum both operands share: XLA sums over it
    if _shared_in_another_order(split, state.spec(op.linked_outputs[0])):
        return fax, templates
    if not any(result):
        return _both_gathered_whole(op, state, split, fax, templates, templates_of)
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


def _both_gathered_whole(op: Op, state, split: list[dict[int, Axes]], fax: dict[int, Axes], templates: Templates,
                         templates_of: TemplatesOf) -> tuple[dict, Templates]:
    """(factor axes, templates) of a dot whose operands both split the sum alone, no summed dim on
    the same axes in both, its result whole: XLA's dot partitioner finds no partial sum to share
    and no result split to run in, and, as its last resort, gathers both operands whole and runs
    the dot unsplit, rather than resharding one operand to the other's split of the sum. Measured
    on jax 0.10.2, mesh 2x4, ``bsh,hd->bsd`` (a dense layer's forward, its result fed to a tanh or
    a program output), the sum over 'model', 'data', ('data', 'model') or ('model', 'data') in
    one operand and another of them in the other (a prefix of it or disjoint), the activation 4x
    the weight or 1/8 of it: both gathered whole every time (the estimate resharded the weight to
    the activation's split and all-reduced the result: 0.12-0.64x XLA's bytes sent, 1/8-1/2 its
    dot FLOPs). Operands split on free dims too: not measured, as before."""
    if not (split[0] and split[1]):
        return fax, templates
    for vid, got in zip(op.linked_inputs, split, strict=True):
        if {a for axes in state.spec(vid) for a in axes} != {a for axes in got.values() for a in axes}:
            return fax, templates  # split on a free dim too: not measured
    return {}, templates_of(op, state, {})


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


def _shared_in_another_order(split: list[dict[int, Axes]], result: Sequence[Axes]) -> bool:
    """Whether both operands split a summed factor over the same mesh axes in different orders
    and the result splits no dim over two of them: XLA permutes one operand's tiles into the
    other's order and sums the partial results
    (:func:`reordered_sum`). Measured on jax 0.10.2, mesh 2x4,
    ``kb,kn->bn``, one operand on ('data', 'model'), the other on ('model', 'data'): the result
    replicated or on ('data', 'model') over its two dims, one permute and the sums; the result's
    n on ('data', 'model'), the dot run in the result's layout (one operand gathered whole).

    >>> _shared_in_another_order([{0: ("data", "model")}, {0: ("model", "data")}], ((), ()))
    True
    >>> _shared_in_another_order([{0: ("data", "model")}, {0: ("model", "data")}], ((), ("data", "model")))
    False
    """
    for f, axes in split[1].items():
        mine = split[0].get(f, ())
        if mine != axes and set(mine) == set(axes) and all(len(set(dim) & set(axes)) < 2 for dim in result):
            return True
    return False


def reordered_sum(op: Op, state, fax: dict[int, Axes], templates: Templates,
                  templates_of: TemplatesOf) -> tuple[dict, Templates] | None:
    """(factor axes, templates) of a contraction whose operands split one factor over the same mesh
    axes in different orders (its factor solution drops the factor, both operands gathered, or
    takes the smaller operand's order), run split in the larger operand's order where that moves
    fewer bytes: XLA permutes the smaller operand's tiles into that order
    (:func:`automap.tile_order.tile_permute`) and sums the pieces (where the result allows it:
    :func:`_shared_in_another_order`). Measured on jax 0.10.2, mesh 2x4: ``kb,kn->bn`` with g
    (96, 8) on ('data', 'model') and w (96, 64) on ('model', 'data'): one 384 B collective-permute and an all-reduce of the
    (8, 64) sum, where both gathered whole were 27,648 B (an equinox GRU's input gradient in its
    scan's backward)."""
    summed, carried = set(op.rule.reduction_factors), {}
    for vid, dims in zip(op.linked_inputs, op.rule.operands, strict=True):
        spec = state.spec(vid)
        for d, fs in enumerate(dims):
            if len(fs) == 1 and fs[0] in summed and spec[d]:
                carried.setdefault(fs[0], []).append((vid, spec[d]))
    best = None
    for f, got in carried.items():
        orders = {axes for _, axes in got}
        if len(orders) < 2 or len({frozenset(a) for a in orders}) != 1:
            continue
        lead = max(got, key=lambda g: state.program.values[g[0]].nbytes)[1]
        if fax.get(f) == lead or any(set(lead) & set(axes) for g, axes in fax.items() if g != f):
            continue
        alt = {**fax, f: lead}
        other = templates_of(op, state, alt)
        if moved_bytes(other) < moved_bytes(best[1] if best else templates):
            best = (alt, other)
    return best
