"""The free splits a dot keeps where its result is a program output that leaves their dims whole:
``out_shardings`` fix the returned value, not the dot's own result (see
:mod:`automap.contraction_layouts`)."""
from __future__ import annotations

from automap.factors import Axes
from automap.ir.program import Op


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
