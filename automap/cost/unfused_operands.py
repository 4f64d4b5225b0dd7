"""What XLA:CPU leaves outside the fusion of a reduction that it runs as a library fusion: the
buffers :func:`automap.cost.memory.temp_peak` counts for it on a CPU topology."""
from __future__ import annotations

import collections
import math
from typing import Collection, Mapping, Sequence

from automap.ir.program import Op, Program
from automap.rules import traits_of
from automap.rules.traits import no_flops

__all__ = ["unfused_reduction_operands"]


def unfused_reduction_operands(
    program: Program, ops: Sequence[Op], keep: set[int], library: Collection[int],
) -> tuple[set[int], list[tuple[int, int, int]]]:
    """What XLA:CPU's reductions at positions ``library`` (:func:`automap.cost.xla_cpu.library_fused`)
    leave outside their fusion (a library fusion of the elementwise work that feeds them alone;
    a smaller reduction's loop fusion computes all of it inline): walking up a reduction's fused operands, a value
    another op reads too is computed into a buffer of its own (the first result, values), and an
    operand broadcast to more elements (non-scalar: a ``broadcast_in_dim``, or an elementwise op's
    unit dims) is a buffer of the broadcast size, made where its source is made (XLA schedules it
    there) and kept until the last reduction that reads it (the second, as (first op, last op,
    broadcast value)). A library fusion takes no lookup: where the walk meets a fused ``gather``
    (:func:`automap.cost.bufferless_lookups.fused_lookups`), the reduction's operand is the result of a loop
    fusion around it, stored (a nearest-neighbour upsampling added to a skip, then summed)."""
    values = program.values

    def graph() -> tuple[Mapping[int, int], Mapping[int, tuple[int, Op]], Mapping[tuple[int, tuple], int]]:
        readers: collections.Counter[int] = collections.Counter()
        for op in ops:
            readers.update(set(op.inputs))
        made = {v: (i, op) for i, op in enumerate(ops) for v in op.outputs}
        spreads: collections.Counter[tuple[int, tuple]] = collections.Counter()  # (source, shape) -> ops spreading it
        for op in ops:
            if op.outputs and not op.regions:
                n = math.prod(values[op.outputs[0]].shape)
                spreads.update({(u, values[op.outputs[0]].shape) for u in op.inputs
                                if 1 < math.prod(values[u].shape) < n})
        return readers, made, spreads

    readers, made, spreads = program.memo_of(ops, ("reduction_graph",), graph)
    cuts: set[int] = set()
    spread: dict[tuple[int, tuple], list[int]] = {}  # (source, shape) -> [first, last, broadcast value]
    for at in sorted(library):
        op = ops[at]
        stack = [(v, v) for v in op.inputs]  # (value, the reduction's operand it feeds)
        while stack:
            v, root = stack.pop()
            if v not in made or v in keep or v in cuts:
                continue
            if made[v][1].primitive == "gather":  # a fused lookup: a loop fusion (a concatenation's own)
                if traits_of(op.primitive).flops is not no_flops:  # a reduction reads it stored
                    cuts.add(root)
                continue
            if readers.get(v, 0) > 1 and not _bitcast(made[v][1], values):
                cuts.add(v)
                continue
            for u in made[v][1].inputs:
                if spreads.get((u, values[v].shape), 0) > 1:  # one broadcast (XLA's CSE) that other fusions read
                    got = spread.setdefault((u, values[v].shape), [made.get(u, (0,))[0], at, v])
                    got[1] = max(got[1], at)
                else:
                    stack.append((u, root))
    return cuts, [tuple(s) for s in spread.values()]


def _bitcast(op: Op, values) -> bool:
    """A reshape (unit dims added or dropped): a bitcast in XLA, which every reader reads in place
    (``x[None]`` of a parameter): no buffer of its own, whatever reads it."""
    return (op.primitive in ("broadcast_in_dim", "reshape", "squeeze", "expand_dims") and len(op.inputs) == 1
            and math.prod(values[op.inputs[0]].shape) == math.prod(values[op.outputs[0]].shape))
