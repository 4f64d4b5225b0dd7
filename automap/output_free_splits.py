"""The free splits a dot summing partial results keeps, where its result does not want them: a
program output that leaves their dims whole (``out_shardings`` fix the returned value, not the
dot's own result, see :mod:`automap.contraction_layouts`), or a result that wants their dims on
the summed axes alone, where that moves fewer bytes."""
from __future__ import annotations

from typing import Callable

from automap.factors import Axes
from automap.ir.program import Op
from automap.reshard_bytes import moved_bytes


def free_splits_an_output_leaves_whole(op: Op, state, free: list[dict[int, Axes]],
                                       alt: dict[int, Axes]) -> dict[int, Axes]:
    """factor -> axes of the operands' free splits (``free``, one dict per operand) that a dot
    summing partial results keeps where its result is a program output wanting their dims whole
    and their axes nowhere else (on no dim of the output, no factor of ``alt``, the dot's layout so
    far): XLA runs the dot split so, reduce-scatters the partial result onto the dims the output
    splits over the summed axes and gathers the kept axes at the return. Measured on jax 0.10.2,
    mesh 2x4, ``bhwi,bhwo->io`` (a 1x1 conv's kernel gradient), both batches on 'data', ``o`` on
    'model' and the output's ``i`` on 'data' (``x``'s features 2x or 8x ``dy``'s; or ``i`` on
    'model' and ``o`` on 'data'): a reduce-scatter over 'data' and a gather over 'model' of the
    result, the dot split 8 ways (the estimate gathered the operand over 'model' and split the dot
    2 ways: 7x XLA's bytes sent, 4x its FLOPs). Where the output wants the kept dim on a summed
    axis (``o`` on 'data'), XLA's choice varies with the sizes (an all-reduce and a permute, or
    the operand gathered): not kept, as before. An intermediate result: not measured, none kept."""
    out = op.linked_outputs[0]
    if out not in state.program.outputs:
        return {}
    wanted = state.spec(out)
    taken = {a for axes in wanted for a in axes} | {a for axes in alt.values() for a in axes}
    whole = {f for axes, fs in zip(wanted, op.rule.results[0], strict=True) if not axes for f in fs}
    return {f: axes for split in free for f, axes in split.items()
            if f in whole and f not in alt and not set(axes) & taken}


def free_splits_kept(op: Op, state, free: list[dict[int, Axes]], alt: dict[int, Axes],
                     templates_of: Callable) -> tuple[dict[int, Axes], tuple | None]:
    """(factor axes, reshard templates) of a dot summing partial results (``alt``, its layout so
    far) with the operands' free splits (``free``, one dict per operand) it keeps:
    :func:`free_splits_an_output_leaves_whole`, then :func:`_kept_over_their_sum`; the templates
    None where they were not needed to choose (``templates_of`` gives them)."""
    alt = {**alt, **free_splits_an_output_leaves_whole(op, state, free, alt)}
    return _kept_over_their_sum(op, state, free, alt, templates_of)


def _kept_over_their_sum(op: Op, state, free: list[dict[int, Axes]], alt: dict[int, Axes],
                         templates_of: Callable) -> tuple[dict[int, Axes], tuple | None]:
    """(factor axes, reshard templates or None) of a dot summing partial results (``alt``, its layout so
    far) with an operand's free split (``free``, one dict per operand) on a dim the result wants
    split over summed axes alone, the free split's axes nowhere else in the result or ``alt``:
    XLA keeps the free split where that moves fewer bytes, all-reduces the partial result over the
    summed axes and reshards it onto them after; otherwise it gathers the operand and
    reduce-scatters the partial result into place (``alt`` as it is). Measured on jax 0.10.2,
    meshes 2x4 and 4x2, ``bsd,bsh->dh`` (a dense layer's weight gradient), both batches on
    'data', ``bsh``'s features on 'model', the result's ``h`` on 'data' (``bsh`` 1/4x to 4x
    ``dh``, a program output or transposed into one): 'model' kept, an all-reduce over 'data',
    the dot split 8 ways (the estimate gathered ``bsh`` over 'model' and split it 2 ways: 1.7x
    XLA's bytes sent, 2.8x its memory, in ``benchmarks/layout_matrix.py``); ``bsd,hd->bsh`` (the
    input gradient), the sum on 'model' in both, the kernel's ``h`` on 'data' and the result's
    on 'model' (the kernel 1/4x the result): the kernel gathered over 'data', a reduce-scatter
    over 'model', as the bytes say (kept, the estimate was 1.10x XLA's bytes sent)."""
    rule = op.rule
    wanted = state.spec(op.linked_outputs[0])
    summed = {a for f in rule.reduction_factors for a in alt.get(f, ())}
    taken = {a for axes in wanted for a in axes if a not in summed} | {a for axes in alt.values() for a in axes}
    over_sum = {f for axes, fs in zip(wanted, rule.results[0], strict=True) if axes and set(axes) <= summed for f in fs}
    kept = {f: axes for split in free for f, axes in split.items()
            if f in over_sum and f not in alt and not set(axes) & taken}
    if not kept:
        return alt, None
    base = templates_of(op, state, alt)
    more = {**alt, **kept}
    other = templates_of(op, state, more)
    return (more, other) if moved_bytes(other) < moved_bytes(base) else (alt, base)
