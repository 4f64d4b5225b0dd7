"""What XLA:CPU leaves outside the fusion of a reduction that it runs as a library fusion: the
buffers :func:`automap.cost.memory.temp_peak` counts for it on a CPU topology."""
from __future__ import annotations

import collections
import math
from typing import Callable, Collection, Mapping, Sequence

from automap.cost.xla_cpu import LIBRARY_ELEMENTS, over_unit_dims
from automap.ir.program import Op, Program
from automap.rules import traits_of
from automap.rules.traits import no_flops

__all__ = ["library_consumers", "unfused_reduction_operands"]


def unfused_reduction_operands(
    program: Program, ops: Sequence[Op], keep: set[int], library: Collection[int],
    consumers: Mapping[int, Collection[int]] | None = None,
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
    fusion around it, stored (a nearest-neighbour upsampling added to a skip, then summed).

    ``consumers``: reduction position -> the positions of the ops below it that its fusion takes
    in too (:func:`library_consumers`). A value every reader of which is in the fusion is computed
    inside it, not stored: an attention's scores gradient (a dot), read by the softmax gradient's
    row sum and by the division the sum's broadcast is added to, is one YNNPACK fusion with
    both (nnx ``dot_product_attention`` under ``nnx.remat`` in ``nnx.scan``, 2 MiB scores a device:
    the gradient was stored next to the dot's result)."""
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
        below = consumers.get(at, ()) if consumers else ()
        fused = _fused_readers(program, ops, made, keep, at, below) if below else frozenset()
        group = {at, *below}
        stack = [(v, v) for i in group for v in ops[i].inputs if made.get(v, (-1,))[0] not in group]
        while stack:
            v, root = stack.pop()
            if v not in made or v in keep or v in cuts:
                continue
            if made[v][1].primitive == "gather":  # a fused lookup: a loop fusion (a concatenation's own)
                if traits_of(op.primitive).flops is not no_flops:  # a reduction reads it stored
                    cuts.add(root)
                continue
            if readers.get(v, 0) > 1 and not _bitcast(made[v][1], values) and v not in fused:
                cuts.add(v)
                continue
            for u in made[v][1].inputs:
                # one broadcast (XLA's CSE) that other fusions read; inside the fusion, its own
                if spreads.get((u, values[v].shape), 0) > 1 and v not in fused:
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


def _fused_readers(program: Program, ops: Sequence[Op], made: Mapping[int, tuple[int, Op]], keep: Collection[int],
                   at: int, below: Collection[int]) -> frozenset[int]:
    """Values above the reduction at ``at`` whose every reader is in its library fusion (the
    reduction, the ops ``below`` it takes in, and the ops above both feed alone), grown as XLA's
    ``LibraryRewriter`` grows it: an operand joins once all its users have."""
    def positions() -> Mapping[int, frozenset[int]]:
        got: dict[int, set[int]] = collections.defaultdict(set)
        for i, op in enumerate(ops):
            for v in op.inputs:
                got[v].add(i)
        return {v: frozenset(rs) for v, rs in got.items()}

    readers = program.memo_of(ops, ("reader_positions",), positions)
    group = {at, *below}
    fused: set[int] = set()
    grew = True
    while grew:
        grew = False
        for v in [v for i in group for v in ops[i].inputs]:
            if v in made and v not in keep and v not in fused and readers[v] <= group:
                fused.add(v)
                group.add(made[v][0])
                grew = True
    return frozenset(fused)


def library_consumers(program: Program, ops: Sequence[Op], library: Collection[int],
                      size: Callable[[int], int], outputs: Collection[int] = ()) -> dict[int, tuple[int, ...]]:
    """Reduction position in ``library`` (its reductions, not its concatenations and pads) ->
    positions of the ops below it that XLA:CPU's YNNPACK fusion of it takes in: from the
    reduction down, while a result is no output and has one reader, and that reader is an
    arithmetic elementwise op (no ``bool`` value: no comparison, no ``select_n``), a broadcast or
    a bitcast (:func:`_bitcast`; a reduction over unit dims) holding
    :data:`automap.cost.xla_cpu.LIBRARY_ELEMENTS` elements a device (``size``: bytes per device),
    as ``LibraryRewriter`` grows a library fusion down (a softmax gradient's row sum takes in its
    negation, its broadcast and the sum with the division it is added to where it is
    f32[1, 8, 4, 128] a device; at f32[1, 2, 4, 128] a loop fusion computes them). Another
    library reduction ends it."""
    values = program.values

    def graph() -> tuple[Mapping[int, tuple[int, ...]], frozenset[int]]:
        readers: dict[int, list[int]] = collections.defaultdict(list)
        for i, op in enumerate(ops):
            for v in dict.fromkeys(op.inputs):
                readers[v].append(i)
        joins = frozenset(i for i, op in enumerate(ops) if _joins_library_fusion(op, values))
        return {v: tuple(rs) for v, rs in readers.items()}, joins

    readers, joins = program.memo_of(ops, ("library_consumers_graph",), graph)
    out: dict[int, tuple[int, ...]] = {}
    for at in library:
        taken: list[int] = []
        op = ops[at]
        if "axes" not in op.params:  # a concatenation or pad: no reduction to grow from
            continue
        while len(op.outputs) == 1 and op.outputs[0] not in outputs and len(readers.get(op.outputs[0], ())) == 1:
            nxt = readers[op.outputs[0]][0]
            op = ops[nxt]
            if nxt not in joins or nxt in library or max(
                    size(v) // max(values[v].itemsize, 1) for v in (*op.inputs, *op.outputs)) < LIBRARY_ELEMENTS:
                break
            taken.append(nxt)
        if taken:
            out[at] = tuple(taken)
    return out


def _joins_library_fusion(op: Op, values) -> bool:
    """Whether a YNNPACK fusion takes ``op`` in: arithmetic elementwise (no ``bool`` value), a
    broadcast, a bitcast, a reduction over unit dims only (a bitcast too)."""
    if op.regions or len(op.outputs) != 1 or any(values[v].dtype == bool for v in (*op.inputs, *op.outputs)):
        return False
    if _bitcast(op, values) or op.primitive == "broadcast_in_dim":
        return True
    traits = traits_of(op.primitive)
    if traits.memory == "result":
        return over_unit_dims(values, op)
    return traits.memory in ("fused", "expensive") and traits.flops is not no_flops
