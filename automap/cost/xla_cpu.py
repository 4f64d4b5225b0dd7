"""The buffers XLA:CPU's compiler adds to a program beyond its values, as the memory estimate
(:mod:`automap.cost.memory`) adds them: read off what XLA:CPU compiles (buffer assignment and
schedule of small programs, ``tests/automap/cost/test_against_xla.py``). Each rule is applied only
when the estimate's topology is a CPU one (:attr:`automap.cost.topology.Topology.platform`).
"""
from __future__ import annotations

import math
from typing import Callable, Collection, Mapping, Sequence

from automap.analysis import POOLING_GRADIENTS, Reshard
from automap.cost.xla_cpu_convs import (batch_grouped, computed_result_bytes, conv_layout_copies, convs_copying,
                                         local_groups)
from automap.ir.program import Op, Program
from automap.rules import traits_of
from automap.shardings import ShardingState

__all__ = ["conv_layout_copies", "cpu_spans", "from_constants", "gathers_minor", "library_fused",
           "over_unit_dims", "pool_gradient_spans", "replaces_workspace", "windowed_reductions"]

LIBRARY_ELEMENTS = 4096
"""The fewest elements on a device of an op's result or operand for XLA:CPU to prefer its YNNPACK
library fusions over its own loop fusion (``IsInstructionPreferredByYnn``,
``xla/backends/cpu/ynn_support.cc``)."""


def cpu_spans(
    program: Program, ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]],
    size: Callable[[int], int], body: bool, state: ShardingState, made: Mapping[int, int], in_place: Collection[int],
    entry: tuple[Mapping[int, int], Collection[int]] = ({}, ()),
) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of the buffers XLA:CPU adds to ``ops``:

    - a reduce-scatter is an all-reduce into a buffer of the whole result, then a slice: the
      reduced copy lives next to the partial result at its op (in a loop body both already wait
      for the combined reduction, :func:`_reshard_spans`);
    - an all-gather along a dim after one of more than one element (:func:`gathers_minor`)
      gathers into a buffer with that dim major and copies it into the row-major layout: the
      gathered operand is there twice at its first use;
    - a batch-grouped convolution (a depthwise conv's kernel gradient,
      :func:`~automap.cost.xla_cpu_convs.expanded_densely`) is expanded into a dense one over the
      groups a device holds (:func:`~automap.cost.xla_cpu_convs.local_groups`): its
      result that many times over, twice, while it runs;
    - a convolution out of Eigen's order (:func:`conv_layout_copies`) reads transposed copies of
      its operands, each made when the operand is (XLA schedules the transpose right after its
      source; a program input's at the start) and kept until the convolution, which reads them
      instead of the operand (an operand only such convolutions read is written transposed in the
      first place: ``in_place``; a resharded one, gathered whole, is copied at the op; one
      gathered along a minor dim once, from the gathered layout into the convolution's: a
      3x3x32x32 kernel split on its input features, gathered for its input gradient, 73,728 B of
      temporaries by XLA's measure, 115,200 B estimated before). Its result, written in Eigen's
      order and then transposed, adds nothing: the transpose runs after the operands' copies are
      freed (XLA's measure of a weight gradient and of an NCHW convolution). Only in the entry
      computation (loop bodies are not canonicalised);
    - a max-pool gradient (``select_and_scatter_add``) is split in two, its selection run in the
      forward (:func:`pool_gradient_spans`; only in the entry computation, where XLA schedules it
      so: in a loop body its workspace is counted at the op, as on other platforms).

    - an all-reduce of an op's result holds buffers of its own (:func:`_all_reduce_spans`), in the
      entry computation.

    ``entry``: (position -> the later one where XLA runs the op's combined reduction,
    :func:`automap.cost.schedule.combined_reductions`; the program's outputs), in the entry
    computation. ``index``: op id -> position in ``ops``; ``made``: value -> position of the op in ``ops`` that
    makes it (absent: made before, a program input at the start); ``size``: bytes per device."""
    combined, outputs = entry
    spans = []
    copied_minor = set()  # (position, value): a gather's row-major copy there
    for op_id, rs in reshards.items():
        i = index.get(op_id)
        if i is None:
            continue
        for r in rs:
            if r.where == "result" and r.kind == "reduce-scatter" and not body:
                spans.append((combined.get(i, i), combined.get(i, i), r.bytes))
            elif r.where == "operand" and r.kind == "all-gather" and not r.reused \
                    and gathers_minor(program.values[r.value].shape, state.specs.get(r.value), r.axes, state.axes):
                spans.append((i, i, r.bytes))
                copied_minor.add((i, r.value))
    for i, op in batch_grouped(program, ops):
        spans.append((i, i, 2 * computed_result_bytes(op, state) * local_groups(op, state)))
    if body:
        return spans
    spans.extend(_all_reduce_spans(index, reshards, size, outputs, len(ops) - 1, combined))
    for i, op in _pool_gradients(program, ops):
        spans.extend(pool_gradient_spans(op, i, made, size, state))
    for i, op, copies in convs_copying(program, ops):
        rs = reshards.get(op.id, ())
        for v, copied in zip(op.inputs[:2], copies[:2]):
            gathered = [r.bytes for r in rs if r.where == "operand" and r.value == v]
            if copied and gathered and (i, v) not in copied_minor:  # the resharded operand is copied at the op
                spans.append((i, i, max(gathered)))
            elif copied and v not in in_place:
                spans.append((made.get(v, 0), i, size(v)))
    return spans


def _all_reduce_spans(
    index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]], size: Callable[[int], int],
    outputs: Collection[int], last: int, combined: Mapping[int, int],
) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of the buffers an all-reduce of an op's result holds at the op, in an
    entry computation: XLA:CPU's all-reduce writes a buffer of its own, so the partial result is
    a temporary next to it when the reduced value is a program output (the output's buffer holds
    the reduced copy), and both are when the value is stored split further than it is reduced
    (all-reduced whole, then sliced, as a reduce-scatter: one dense layer's input gradient all-reduced
    over ``model`` into its output; its weight gradient, summed over a batch split 8 ways and stored
    split over ``data`` and ``model``, a 16 KiB partial and its 16 KiB reduced copy). One pair
    per (op, value), of the largest all-reduce there."""
    whole: dict[tuple[int, int], int] = {}
    for op_id, rs in reshards.items():
        i = index.get(op_id)
        for r in rs if i is not None else ():
            if r.where == "result" and r.kind == "all-reduce" and (r.bytes > size(r.value) or r.value in outputs):
                whole[(i, r.value)] = max(whole.get((i, r.value), 0), r.bytes)
    spans = []
    for (i, v), nbytes in whole.items():
        after = combined.get(i, min(i + 1, last))  # the all-reduce runs after the op, its operands freed
        spans.append((i, after, nbytes))  # the partial result
        if v not in outputs:
            spans.append((after, after, nbytes))  # its reduced copy, then sliced
    return spans


def gathers_minor(shape: Sequence[int], spec: Sequence[Sequence[str]] | None, axes: Sequence[str],
                  sizes: Mapping[str, int]) -> bool:
    """Whether gathering ``axes`` of a value of ``shape`` laid out as ``spec`` gathers along a dim
    after one that holds more than one element a device: XLA:CPU's all-gather concatenates along
    the most major dim, so it gathers into a buffer with that dim major, then copies that into the
    row-major layout (``{2,1,0,3}`` then ``{3,2,1,0}`` for a kernel gathered on its dim 3).

    >>> sizes = {"data": 8}
    >>> gathers_minor((256, 64), (("data",), ()), ("data",), sizes), gathers_minor((256, 64), ((), ("data",)), ("data",), sizes)
    (False, True)
    >>> gathers_minor((1, 1, 256), ((), (), ("data",)), ("data",), sizes)  # the dims before it are 1
    False
    """
    if not spec:
        return False
    gathered = [d for d, dim in enumerate(spec) if any(a in axes for a in dim)]
    if not gathered:
        return False
    kept = [math.prod(sizes[a] for a in dim if a not in axes) for dim in spec]
    return any(shape[d] // kept[d] > 1 for d in range(gathered[0]))


def from_constants(program: Program, ops: Sequence[Op]) -> frozenset[int]:
    """Values of ``ops`` computed from literals and constants alone (a zero ``broadcast_in_dim``,
    an ``iota``): XLA:CPU's schedule computes them first, at the start of the program, so one
    that is a buffer (the zeroed operand a ``scatter-add`` writes into: a ``segment_sum``, the
    gradient of a gather) lives from there to its last reader (XLA's live ranges of a message-
    passing GNN's training step: the zeroed buffers of the four scatter-adds of its backward, made
    before its first layer, held to the end of the backward)."""
    def compute() -> frozenset[int]:
        values = program.values
        out: set[int] = set()
        for op in ops:
            if not op.regions and all(v in out or values[v].kind in ("literal", "const") for v in op.inputs):
                out.update(op.outputs)
        return frozenset(out)

    return program.memo_of(ops, ("from_constants",), compute)


def constants_as_read(program: Program, ops: Sequence[Op], size: Callable[[int], int]) -> dict[int, int]:
    """value id -> bytes, for the values of :func:`from_constants` that an op reads into a result
    of their shape split further than they are (a replicated zeroed buffer that a ``scatter-add``
    split over a mesh axis writes into): XLA partitions a broadcast constant as its reader needs
    it, so its buffer is that result's size (the held-out odd-sized GPT's gradient of
    ``take_along_axis``: zeros f32[6,12,1001] replicated in the plan, XLA's f32[6,3,1001])."""
    def pairs() -> tuple[tuple[int, int], ...]:
        first, values = from_constants(program, ops), program.values
        return tuple((v, o) for op in ops for v in op.inputs if v in first
                     for o in op.outputs if values[o].shape == values[v].shape)

    out: dict[int, int] = {}
    for v, o in program.memo_of(ops, ("constants_as_read",), pairs):
        if size(o) < out.get(v, size(v)):
            out[v] = size(o)
    return out


def library_fused(program: Program, ops: Sequence[Op], size: Callable[[int], int]) -> frozenset[int]:
    """Positions in ``ops`` of the ops whose result is a buffer read from fused operands (a
    reduction) that XLA:CPU runs as a YNNPACK library fusion: those whose result or an operand
    holds at least :data:`LIBRARY_ELEMENTS` elements on a device (``size``: bytes per device).
    A smaller one is a loop fusion, which computes every elementwise operand inline (an RMSNorm
    of f32[2,16,64] a device: XLA's reductions read nothing but the norm's input; of
    f32[4,16,64]: library fusions, which leave out what
    :func:`automap.cost.unfused_operands.unfused_reduction_operands` counts)."""
    def candidates() -> tuple[tuple[int, tuple[int, ...]], ...]:
        return tuple((i, (*op.inputs, *op.outputs)) for i, op in enumerate(ops)
                     if traits_of(op.primitive).memory == "result" and not op.regions
                     and not over_unit_dims(program.values, op))

    values = program.values
    return frozenset(i for i, vs in program.memo_of(ops, ("library_candidates",), candidates)
                     if max(size(v) // max(values[v].itemsize, 1) for v in vs) >= LIBRARY_ELEMENTS)


def over_unit_dims(values: Mapping, op: Op) -> bool:
    """Whether ``op`` is a reduction whose reduced dims all hold one element: a bitcast to XLA's
    algebraic simplifier, no library fusion (an attention's ``(1, b, h, t, 1)`` row term summed
    to ``(b, h, t)``)."""
    axes = op.params.get("axes")
    return axes is not None and all(values[op.inputs[0]].shape[d] == 1 for d in axes)


TREE_REDUCTION_WINDOW = 32
"""XLA:CPU's ``TreeReductionRewriter`` window: a reduction of a dim longer than this is a
reduce-window of that size, then a reduce (``xla/hlo/transforms/simplifiers/tree_reduction_rewriter.cc``)."""


def windowed_reductions(program: Program, ops: Sequence[Op], state: ShardingState,
                        library: Collection[int]) -> frozenset[int]:
    """Positions in ``ops`` of the reductions XLA:CPU runs as a reduce-window, then a reduce:
    those not in ``library`` (:func:`library_fused`) that reduce a dim of more than
    :data:`TREE_REDUCTION_WINDOW` elements on a device. XLA fuses nothing into the
    reduce-window, so it reads the reduction's operand from a buffer of its own (an RMSNorm of
    f32[2,16,64] a device: its ``x * x`` and its gradient's row terms are buffers)."""
    def candidates() -> tuple[tuple[int, int, tuple[int, ...]], ...]:
        return tuple((i, op.inputs[0], tuple(op.params["axes"])) for i, op in enumerate(ops)  # reduce_sum, ...
                     if traits_of(op.primitive).memory == "result" and "axes" in op.params and not op.regions)

    out = set()
    for i, v, axes in program.memo_of(ops, ("reduction_candidates",), candidates):
        if i in library:
            continue
        shape, spec = program.values[v].shape, state.spec(v)
        if any(shape[d] // math.prod(state.axes[a] for a in spec[d]) > TREE_REDUCTION_WINDOW for d in axes):
            out.add(i)
    return frozenset(out)


def replaces_workspace(op: Op, body: bool) -> bool:
    """Whether :func:`cpu_spans` counts what ``op`` holds in place of its traits' workspace (a
    max-pool gradient outside a loop body)."""
    return not body and op.primitive in POOLING_GRADIENTS


def _pool_gradients(program: Program, ops: Sequence[Op]) -> list[tuple[int, Op]]:
    """(position, op) of the max-pool gradients in ``ops``."""
    return program.memo_of(ops, ("pool_gradients",), lambda: [
        (i, op) for i, op in enumerate(ops) if op.primitive in POOLING_GRADIENTS])


def pool_gradient_spans(op: Op, at: int, made: Mapping[int, int], size: Callable[[int], int],
                        state: ShardingState) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of what XLA:CPU holds for a max-pool gradient at position ``at``.
    Its ``SelectAndScatterExpander`` makes it a variadic reduce-window over the pooled input and
    one s32 index array per dim, which picks each window's winner and its index per dim, and a
    scatter of the source into a zeroed input-shaped buffer at those indices. The selection reads
    only the input, and XLA:CPU's schedule runs it as soon as the input is made, in the forward
    (``tests/automap/cost/test_cpu_buffers.py``): the index arrays, which read nothing, exist
    from the start of the program until then (an iota per dim of more than one element a device,
    one zero array shared by the dims of one), as does the zeroed buffer until the scatter writes
    the result into it; the winners' indices, concatenated into one (source elements, rank) s32
    array, live from the selection to the scatter; the winners' values only at the selection. The
    selection of an input made before ``ops`` (a program input) runs at the op itself.

    ``made``: value -> position of the op that makes it. The generic ``select_and_scatter`` (operand, source, init) and ``select_and_scatter_add``
    (source, operand) read their operands in different orders."""
    source, operand = (op.inputs[1], op.inputs[0]) if op.primitive == "select_and_scatter" else op.inputs[:2]
    result = op.outputs[0]
    values = state.program.values
    spec = state.specs.get(result) or ((),) * len(values[result].shape)
    local = [n // math.prod(state.axes[a] for a in dim) for n, dim in zip(values[result].shape, spec)]
    arrays = sum(n > 1 for n in local) + any(n == 1 for n in local)
    index = 4  # s32
    elements = math.prod(local)
    winners = size(source) // max(values[source].dtype.itemsize, 1)
    selected = made.get(operand, at)
    zeroed = [(0, at - 1, size(result))] if at else []  # the scatter writes the result into it, in place
    return [(0, selected, elements * index)] * arrays + zeroed + [
        (selected, at, len(local) * winners * index), (selected, selected, size(source))]


def _bitcast_dot(program: Program, op: Op) -> bool:
    """A ``dot_general`` whose batch dims all hold one element: XLA's algebraic simplifier drops
    them, so the dot reads each operand through a reshape (a bitcast, which fuses)."""
    if op.primitive != "dot_general":
        return False
    lhs_batch = op.params["dimension_numbers"][1][0]
    return bool(lhs_batch) and all(program.values[op.inputs[0]].shape[d] == 1 for d in lhs_batch)


def _cheap(program: Program, op: Op, made: Mapping[int, Op]) -> bool:
    """An elementwise op XLA duplicates into each reader: a ``fused`` one, or a division by a
    broadcast, which XLA's algebraic simplifier makes a multiply by the broadcast reciprocal."""
    if op.primitive == "div" and len(op.inputs) == 2:
        divisor = op.inputs[1]
        return (getattr(made.get(divisor), "primitive", None) == "broadcast_in_dim"
                or math.prod(program.values[divisor].shape) < math.prod(program.values[op.outputs[0]].shape))
    return traits_of(op.primitive).memory == "fused" and not op.regions


def recomputed_beside_dots(program: Program, ops: Sequence[Op], outputs: Collection[int]) -> dict[int, int]:
    """value -> position of its last dot reader, for the cheap elementwise results (``memory``
    trait ``fused``) whose readers all fuse but for dots reading them through a bitcast
    (:func:`_bitcast_dot`): XLA:CPU fuses such a result into every reader, so the bitcast's loop
    fusion stores a copy for the dots while each other reader recomputes it from its operands,
    which stay live until that last reader (optax's Newton-Schulz steps, vmapped over a leading
    dim of one: each step's ``c0 * x + b @ x`` is recomputed in the next step's, so every
    step's ``b @ x`` stays live to the end).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> bmm = jax.lax.batch_matmul
    >>> def step(x):  # a Newton-Schulz-like step on a batch of one
    ...     a = bmm(x, x)
    ...     b = 2.0 * a + bmm(a, a)  # value 5, read by the dot at position 4 and by the last add
    ...     return bmm(b, x) + b
    >>> prog = lower(jax.make_jaxpr(step)(jnp.ones((1, 4, 4))), ["x"], ["y"])
    >>> recomputed_beside_dots(prog, prog.ops, prog.outputs)
    {5: 4}
    """
    def compute() -> dict[int, int]:
        made = {v: op for op in ops for v in op.outputs}
        dots: dict[int, int] = {}
        fused_readers: set[int] = set()
        stored: set[int] = set(outputs)
        for i, op in enumerate(ops):
            bitcast = _bitcast_dot(program, op)
            stores = traits_of(op.primitive).reads_memory or bool(op.regions)
            for v in op.inputs:
                if bitcast:
                    dots[v] = i
                else:
                    (stored if stores else fused_readers).add(v)
        return {v: i for v, i in dots.items() if v in fused_readers and v not in stored and v in made
                and _cheap(program, made[v], made)}

    return program.memo_of(ops, ("recomputed_beside_dots", tuple(outputs)), compute)
