"""Where XLA's schedule of an entry computation runs an op earlier, or a reduction of its result
later, than the program's order, as the memory estimate (:mod:`automap.cost.memory`) moves them.

XLA's memory scheduler runs an op as soon as its operands exist when that frees a resharded
operand sooner: a dense layer's backward reads the gathered weight last in its input gradient
``dy @ w.T``, which the program orders after the weight gradient ``x.T @ dy``; XLA runs the input
gradient first, so the gathered weight is freed before the weight gradient's partial sum (whole
on each device until it is reduce-scattered) is made (one dense layer, batch split 8 ways, weight
FSDP: the two 16 KiB buffers never live together; a two-layer MLP: the same in the second layer).
XLA:CPU combines the gradients' independent reductions into one after the last of them
(:func:`combined_reductions`), and schedules breadth first, so a collective of a value made
from the parameters by a short chain (a reversed kernel) runs near the start of the step
(:func:`breadth_first_starts`).
"""
from __future__ import annotations

import bisect
from typing import Any, Callable, Collection, Mapping, Sequence

from automap.analysis import Reshard
from automap.ir.program import Op

__all__ = ["COMBINED_MOST", "breadth_first_starts", "combined_reductions", "early_readers", "entry_order"]

COMBINED_MOST = 256
"""The most all-reduces XLA:CPU combines into one (``CpuAllReduceCombiner``'s count limit)."""


def entry_order(
    ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]],
    made: Mapping[int, int], size: Callable[[int], int], outputs: Collection[int], dtype: Callable[[int], Any],
) -> tuple[dict[int, int], dict[int, int]]:
    """Where XLA runs the ops of an entry computation ``ops`` otherwise than in their order: (position
    -> the earlier one, :func:`early_readers`; position -> the later one where its result's
    reduction runs, :func:`combined_reductions`; ``dtype``: value -> its element type)."""
    return (early_readers(ops, index, reshards, made, size, outputs),
            combined_reductions(ops, index, reshards, size, dtype))


def early_readers(
    ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]],
    made: Mapping[int, int], size: Callable[[int], int], outputs: Collection[int],
) -> dict[int, int]:
    """position -> earlier position, of the ops in ``ops`` (an entry computation, not a loop
    body) that XLA runs right after the op at the earlier position: each last reader of a
    resharded operand whose own operands all exist there (made at or before it, ``made``: value
    -> position of the op making it) and whose results that are no program ``outputs`` take no
    more bytes (``size``: per device) than the resharded copies it frees. The earlier position is
    also after every other reader of those copies. ``index``: op id -> position."""
    readers: dict[tuple, list[int]] = {}  # (value, kind, axes) -> positions of the ops reading that copy
    nbytes: dict[tuple, int] = {}
    for i, rs in sorted((index[op], rs) for op, rs in reshards.items() if op in index):
        for r in rs:
            if r.where == "operand":
                readers.setdefault((r.value, r.kind, r.axes), []).append(i)
                nbytes[(r.value, r.kind, r.axes)] = r.bytes
    freed: dict[int, list[tuple]] = {}  # position -> the copies it reads last
    for key, at in readers.items():
        freed.setdefault(at[-1], []).append(key)
    out = {}
    for j, keys in freed.items():
        op = ops[j]
        if op.regions:
            continue
        ready = max((made.get(v, -1) for v in op.inputs), default=-1)
        earlier = max([ready] + [at[-2] for key in keys for at in [readers[key]] if len(at) > 1])
        grown = sum(size(v) for v in op.outputs if v not in outputs)
        if 0 <= earlier < j - 1 and grown <= sum(nbytes[key] for key in keys):
            out[j] = earlier
    return out


def breadth_first_starts(ops: Sequence[Op], buffers: Collection[int]) -> dict[int, int]:
    """value -> the position in ``ops`` (an entry computation) from which XLA:CPU has run a
    collective reading it, for the values made in ``ops`` whose collective runs before the op
    after the one making them. XLA:CPU schedules breadth first (``BFSMemoryScheduler``: an
    instruction runs once all its operands have, in the order they became ready), so it runs
    in the order of its depth, the longest chain of instructions from the parameters to it; a
    value's collective runs where the program's own chain first reaches one past the value's
    depth. Depth counts the ops whose result is a buffer (``buffers``; the others fuse into
    their readers): a kernel reversed for a convolution's input gradient (depth 1) is reversed
    and gathered at the start of the step, next to the forward's gathers (held-out ``nn.Conv``
    layers under FSDP: both reversed kernels live through the forward, XLA's 159.7 KiB of
    temporaries; gathered where the backward reverses them, the estimate said 86.1 KiB).

    >>> from types import SimpleNamespace as Op  # inputs, outputs and regions are what it reads
    >>> chain = [Op(inputs=(0,), outputs=(1,), regions=()), Op(inputs=(1,), outputs=(2,), regions=()),
    ...          Op(inputs=(9,), outputs=(3,), regions=())]  # tanh, tanh of it, then rev of input 9
    >>> breadth_first_starts(chain, {1, 2, 3})  # the rev is depth 1: gathered after the first tanh
    {3: 1}
    """
    depth: dict[int, int] = {}
    reached: list[int] = []  # position -> the deepest op at or before it
    for op in ops:
        d = max((depth.get(v, 0) for v in op.inputs), default=0)
        d += bool(op.regions) or any(v in buffers for v in op.outputs)
        depth.update((v, d) for v in op.outputs)
        reached.append(max(d, reached[-1] if reached else 0))
    out = {}
    for i, op in enumerate(ops):
        for v in op.outputs:
            first = bisect.bisect_left(reached, depth[v] + 1)
            if first < i + 1:
                out[v] = first
    return out


def combined_reductions(
    ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]], size: Callable[[int], int],
    dtype: Callable[[int], Any],
) -> dict[int, int]:
    """position -> the later position where XLA runs its reduction, of the ops in ``ops`` (an entry
    computation) whose result is reduced whole, then split (a reduce-scatter, or an all-reduce of a
    value stored split further, ``size``: bytes per device): XLA:CPU makes each an all-reduce and
    combines those over the same axes that do not depend on each other, up to
    :data:`COMBINED_MOST` of them, into one (``CpuAllReduceCombiner``, no byte limit), run when the
    last of their partial results is made, so each partial waits whole until then (a two-layer MLP
    under FSDP: both weight gradients' partials, 64 KiB each, and their reduced copies live
    together, XLA's 262,224 B of temporaries). XLA combines only reductions of one element type
    (``GetAllReduceKey``: the reduction's type is part of the key), so the groups are per axes and
    ``dtype`` (value -> element type). A reduction that reads what an earlier one of its group
    makes starts the next group. Only groups of more than one reduction are listed.

    A result that a later all-reduced sum of its own element type is made from (a gradient's
    square summed into a global norm) is reduced alone: XLA's combiner puts that sum's reduction,
    which reads it, in the next reduction's group, and so no two such gradients in one (the
    two-layer MLP's step clipped by its gradients' norm; the zoo GPT under FSDP, clipped by optax:
    each gradient in its own all-reduce, next to scalars; combined, the estimate was 1.31x XLA's
    memory). A complex gradient's norm is a real sum, combined apart from the complex gradients,
    which XLA combines (a Fourier layer's two complex64 weights under FSDP: one all-reduce of
    both; kept apart, the estimate was 0.71x XLA's memory)."""
    whole: dict[int, list[Reshard]] = {}  # position -> its results reduced whole, then split
    for op, rs in reshards.items():
        got = [r for r in rs if r.where == "result" and (
            r.kind == "reduce-scatter" or (r.kind == "all-reduce" and r.bytes > size(r.value)))]
        if got and op in index:
            whole[index[op]] = got
    if len(whole) < 2:  # no group of more than one
        return {}
    types = {dtype(r.value) for rs in whole.values() for r in rs}
    summed_again = {t: _summed_again(ops, index, reshards, min(whole), lambda v, t=t: dtype(v) == t) for t in types}
    axes_of: dict[int, tuple[frozenset, Any]] = {}  # position -> the key XLA combines its reduction by
    for i, rs in whole.items():
        kept = [r for r in rs if r.value not in summed_again[dtype(r.value)]]
        if kept:
            axes_of[i] = (frozenset(a for r in kept for a in r.axes), dtype(kept[0].value))
    if len(set(axes_of.values())) == len(axes_of):  # each alone on its axes
        return {}
    groups: dict[tuple, list[list[int]]] = {}
    tainted: dict[tuple, set[int]] = {}  # key -> values made from its current group's reduced results
    for i in range(min(axes_of, default=len(ops)), len(ops)):
        op, axes = ops[i], axes_of.get(i)
        if axes is not None:
            got, made = groups.setdefault(axes, [[]]), tainted.setdefault(axes, set())
            if not made.isdisjoint(op.inputs) or len(got[-1]) == COMBINED_MOST:
                got.append([])
                made.clear()
            got[-1].append(i)
            made.update(op.outputs)
        for other, made in tainted.items():
            if other != axes and not made.isdisjoint(op.inputs):
                made.update(op.outputs)
    return {i: group[-1] for got in groups.values() for group in got if len(group) > 1 for i in group}


def _summed_again(
    ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]], after: int,
    typed: Callable[[int], bool],
) -> set[int]:
    """The values made after position ``after`` (and some before) that a later all-reduced sum of
    a value ``typed`` accepts is made from: the inputs, and theirs, of every op whose result is
    so all-reduced, up to ``after``."""
    summing = {index[op] for op, rs in reshards.items() if op in index and any(
        r.where == "result" and r.kind == "all-reduce" and typed(r.value) for r in rs)}
    summed: set[int] = set()
    for i in range(max(summing, default=after), after, -1):
        op = ops[i]
        if i in summing or not summed.isdisjoint(op.outputs):
            summed.update(op.inputs)
    return summed
