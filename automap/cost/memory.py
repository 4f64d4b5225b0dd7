"""Peak memory per device by liveness over the program order.

XLA reports ``argument + output - alias + temp`` per device; the estimate mirrors those terms:
arguments (every input, sharded), outputs, aliased (donated inputs whose buffer an output
reuses) and the peak of the live temporaries walking the ops in order. Only *materialized*
values count as temporaries: XLA fuses chains of elementwise work, so a value made by a fusible
op and read only by fusible ops or reductions never exists in memory; it is recomputed in each
reader's kernel, so the buffers it is computed from stay live until its last reader (a forward
value recomputed in the backward pass keeps its sources alive). An expensive elementwise result
(``exp``, ``tanh``, ...) read by several ops is not recomputed but stored. Which primitive is which
is its record's ``memory`` trait (:data:`automap.rules.traits.Memory`). A ``scan`` adds the peak
of its body (one iteration) while it runs; its stacked outputs are ordinary values (a fully
unrolled one, straight-line code in XLA, is walked as copies of its body: :mod:`automap.cost.unrolled`).
XLA schedules a loop body on its own: its gathers first, its gradient reductions last (:func:`_reshard_spans`).
On a CPU topology the buffers XLA:CPU's compiler adds are counted too (:mod:`automap.cost.xla_cpu`:
a reduce-scatter's whole reduced copy, a gather's layout copy, a convolution's transposed operands;
here: what its reductions do not fuse (:func:`automap.cost.unfused_operands.unfused_reduction_operands`
of the library fusions, :func:`automap.cost.xla_cpu.library_fused`; the operand of a reduce-window,
:func:`automap.cost.xla_cpu.windowed_reductions`), and the random bits' two threefry halves).
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable, Collection, Iterable, Mapping, Sequence

from automap.cost.flops import context
from automap.cost.bufferless_lookups import fused_lookups, scalar_broadcasts
from automap.cost.schedule import breadth_first_starts, entry_order
from automap.cost.unfused_operands import library_consumers, unfused_reduction_operands
from automap.cost.unrolled import inline_unrolled_scans
from automap.cost.cpu_float32 import computed_dtype, computed_itemsize, stored_in_f32
from automap.cost.xla_cpu import (constants_as_read, conv_layout_copies, cpu_spans, from_constants, library_fused,
                                  recomputed_beside_dots, replaces_workspace, windowed_reductions)
from automap.ir.program import Op, Program
from automap.propagate import Reshard
from automap.propagate import reshards as all_reshards
from automap.rules import traits_of
from automap.shardings import ShardingState  # noqa: F401  (doctest)


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    arguments: int
    outputs: int
    aliased: int
    temp: int  # peak of live temporaries (not inputs, not outputs)

    @property
    def peak(self) -> int:
        """``arguments + outputs - aliased + temp``, XLA's per-device total."""
        return self.arguments + self.outputs - self.aliased + self.temp


def materialized(ops: Sequence[Op], outputs: Iterable[int], collected: Collection[int] = ()) -> set[int]:
    """Values of ``ops`` that exist as buffers (see the module docstring): results of
    materializing ops but for :func:`fused_lookups` (``collected``: values a collective reads),
    operands of ops that read memory, and results of expensive elementwise ops that more than one
    op reads."""
    keep = set(outputs)
    readers: collections.Counter[int] = collections.Counter()
    for op in ops:
        readers.update(set(op.inputs))
    broadcasts = scalar_broadcasts(ops)
    lookups = fused_lookups(ops, keep) - frozenset(collected)
    for op in ops:
        if op.primitive == "gather" and op.outputs[0] in broadcasts:
            continue  # a lookup in a broadcast scalar: XLA's simplifier makes it a broadcast
        traits = traits_of(op.primitive)
        if op.outputs and op.outputs[0] in lookups:  # its table and indices read from memory
            keep.update(v for v in op.inputs if v not in lookups)
            continue
        if traits.materializing or op.regions:
            keep.update(op.outputs)
        elif traits.expensive:
            keep.update(v for v in op.outputs if readers[v] > 1)
        if traits.reads_memory or op.regions:
            unread = op.unread_operands
            keep.update(v for v in op.inputs if v not in unread)
    return keep


def temp_peak(
    program: Program, state: ShardingState, ops: Sequence[Op], outputs: Sequence[int],
    reshards: Mapping[int, Sequence[Reshard]] = {}, buffers: Sequence[tuple[int, int]] = (),
    body: bool = False, platform: str | None = None,
) -> int:
    """Peak bytes of live materialized temporaries while ``ops`` run (outputs excluded) that do
    not fit in ``buffers``: (op id that writes it, bytes) of the output buffers, which hold one
    temporary of their own size at a time until the output is written, as XLA's buffer
    assignment reuses them (a gradient in its parameter's future buffer). XLA also places
    smaller values in them; matching sizes exactly predicted XLA's temp best on the zoo GPT
    (``benchmarks/cost_fidelity.py``).

    Resharded operands are temporaries too: a gathered parameter lives from its first use to
    its last (XLA gathers it once and keeps it), an all-to-all copy for the op that needs it;
    ``body``: ``ops`` are a loop body, which XLA schedules otherwise (:func:`_reshard_spans`);
    ``platform``: what that platform's compiler adds (XLA:CPU: :func:`automap.cost.xla_cpu.cpu_spans`)."""
    cpu = platform == "cpu"
    size = stored_in_f32(program, _sizer(state)) if cpu else _sizer(state)  # XLA:CPU computes bf16 in f32
    library = library_fused(program, ops, size) if cpu else frozenset()
    windowed = windowed_reductions(program, ops, state, library) if cpu else frozenset()
    consumers = tuple(sorted(library_consumers(program, ops, library, size, outputs).items())) if cpu else ()
    collected = frozenset(r.value for rs in reshards.values() for r in rs)
    live_ranges = _liveness(program, ops, outputs, conv_copies=cpu and not body, cpu=cpu, library=library,
                            windowed=windowed, collected=collected, consumers=consumers)
    index = live_ranges.index
    first = from_constants(program, ops) if cpu and not body else frozenset()  # made at the start
    read_as = constants_as_read(program, ops, size) if cpu and not body else {}
    made = _producers(program, ops)
    moved, combined = ({}, {}) if body or not cpu else entry_order(
        ops, index, reshards, made, size, outputs, lambda v: computed_dtype(program.values[v]))
    spans = [(0 if v in first else moved.get(s, s), e, read_as.get(v, size(v))) for v, s, e in live_ranges.values]
    spans.extend((s, e, size(v) * copies) for s, e, v, copies in live_ranges.unfused)
    early = {} if body or not cpu else program.memo_of(
        ops, ("breadth_first", tuple(outputs)), lambda: breadth_first_starts(ops, program.memo_of(
            ops, ("materialized", tuple(outputs)), lambda: frozenset(materialized(ops, outputs)))))
    spans.extend(_reshard_spans(program, ops, index, reshards, body, moved, combined, early, widened=cpu))
    if cpu:
        in_place = () if body else _copied_in_place(program, ops, outputs)
        spans.extend(cpu_spans(program, ops, index, reshards, size, body, state, made, in_place, (combined, outputs)))
    for i, op, nbytes in _workspaces(program, ops, platform):  # split as its first result (or operand) is
        if cpu and replaces_workspace(op, body):
            continue
        like = op.inputs[0] if traits_of(op.primitive).workspace_split == "operand" else op.outputs[0]
        spans.append((i, i, nbytes * size(like) // max(program.values[like].nbytes, 1)))
    steps = len(ops) + body  # a body ends with its combined reductions, after its last op
    delta = [0] * (steps + 1)
    for first, last, nbytes in spans:
        delta[first] += nbytes
        delta[last + 1] -= nbytes
    live = list(itertools.accumulate(delta[:steps]))  # after each op starts
    for i, regions in live_ranges.regions:  # a body's own peak while its op runs
        live[i] += max(temp_peak(program, state, r.ops, r.outputs, reshards, body=True, platform=platform)
                       for r in regions)
    if not buffers or not live:
        return max(max(live, default=0), 0)
    # at each point, a temporary live there takes a free output buffer of its size (one written
    # later) while one is left: per size b, min(live temporaries, free buffers) of them are placed
    free = collections.Counter(nbytes for _, nbytes in buffers if nbytes)
    active: collections.Counter = collections.Counter()
    events = [(moved.get(p, p), b, free, -1) for op, b in buffers if b for p in [index.get(op, -1)]]  # written
    events += [(p, b, active, d) for s, e, b in spans if b in free and s <= e for p, d in ((s, 1), (e + 1, -1))]
    events.sort(key=lambda ev: ev[0])
    placed, peak, k = 0, 0, 0
    for i, here in enumerate(live):
        while k < len(events) and events[k][0] <= i:
            _, b, counts, d = events[k]
            k += 1
            placed -= b * min(active[b], free[b])
            counts[b] += d
            placed += b * min(active[b], free[b])
        peak = max(peak, here - placed)
    return peak


def _reshard_spans(
    program: Program, ops: Sequence[Op], index: Mapping[int, int], reshards: Mapping[int, Sequence[Reshard]],
    body: bool, moved: Mapping[int, int] = {}, combined: Mapping[int, int] = {}, early: Mapping[int, int] = {},
    widened: bool = False,
) -> list[tuple[int, int, int]]:
    """(first, last, bytes) of the temporaries the reshards at ``ops`` make: a resharded operand
    from when its collective runs to its last use (XLA reshards it once and keeps it), the whole
    partial result of a reduce-scatter at its op.

    XLA's schedule runs a collective as soon as its operand exists: a parameter's gather at the
    start of the step, a forward value's gather or all-to-all for the backward right after the
    value is made (the held-out MLP-Mixer's whole-mesh FSDP: activations gathered in the forward
    for the backward's weight gradients, est 154,792 -> 281,768 B vs XLA's 274,696; nnx
    transformer fsdp_tp: all-to-alls of the forward's activations, est/XLA 0.77 -> 0.94). In a
    loop ``body`` (``benchmarks/fidelity.py``, the scanned GPT under FSDP) an operand gathered
    from a body input (the iteration's slice of a stacked parameter) is gathered at the body's
    start; and the body's reduce-scatters are combined into one collective after its last op, so
    each partial result stays whole until then, next to its reduced copy (XLA:CPU all-reduces,
    then slices); that step is position ``len(ops)``. ``moved``, ``combined``: :mod:`automap.cost.schedule`;
    ``early``: value -> the earlier position where XLA:CPU's breadth-first schedule runs its
    collective (:func:`automap.cost.schedule.breadth_first_starts`: the backward's reversed kernels
    gathered at the start of the step). There XLA runs the value's whole chain of steps (a
    collective-permute of the shard, then the gather) and frees each step's operand as the next
    one is made: only the chain's last step is held until the op (held-out ``nn.ConvTranspose``
    under fsdp_tp: each reversed kernel's 3 KiB moved shard was counted next to its 12 KiB gather
    through the forward). ``widened``: half-precision copies at XLA:CPU's float32 bytes
    (:func:`automap.cost.cpu_float32.computed_itemsize`).""" 
    copies: dict[tuple, list[int]] = {}  # (value, kind, axes) -> [first, last, bytes]
    passed: dict[tuple, bool] = {}  # key -> only ever a step before the last of an early chain
    made = _producers(program, ops)
    end = len(ops)  # in a body: the step after its last op
    values = program.values
    for i, rs in sorted((index[op], rs) for op, rs in reshards.items() if op in index):  # in program order
        last = {r.value: r for r in rs if r.where == "operand"}
        for r in rs:
            v = values[r.value]
            nbytes = r.bytes * computed_itemsize(v) // max(v.itemsize, 1) if widened else r.bytes
            if r.where == "operand":
                first = made.get(r.value, 0) if body else (
                    min(made[r.value] + 1, early.get(r.value, len(ops))) if r.value in made else 0)
                got = copies.setdefault((r.value, r.kind, r.axes), [min(first, i), i, nbytes])
                got[1] = i
                key = (r.value, r.kind, r.axes)
                passed[key] = passed.get(key, True) and r.value in early and last[r.value] is not r
            elif r.kind == "reduce-scatter":  # the partial result exists whole before it is scattered
                copies[(r.value, r.kind, r.axes, i)] = [i, end if body else combined.get(i, i), nbytes]
                if body:
                    copies[(r.value, r.kind, r.axes, i, "reduced")] = [end, end, nbytes]
    for got in (got for key, got in copies.items() if len(key) == 3 and got[1] in moved):  # a copy read last there
        got[1] = max(moved[got[1]], got[0])
    for key in (key for key, only in passed.items() if only):  # freed once the next step is made
        copies[key][1] = copies[key][0]
    return [tuple(c) for c in copies.values()]


def _copied_in_place(program: Program, ops: Sequence[Op], outputs: Sequence[int]) -> frozenset[int]:
    """Values made in ``ops`` that only convolutions read, each through a transposed copy
    (:func:`automap.cost.xla_cpu.conv_layout_copies`), and that are no output: XLA writes them transposed in the first
    place (the transpose fuses into their producer), so the copy is their own buffer."""
    def compute() -> frozenset[int]:
        copied: set[int] = set()
        other: set[int] = set(outputs)
        for op in ops:
            flags = conv_layout_copies(op, program)[:2]
            for k, v in enumerate(op.inputs):
                (copied if k < len(flags) and flags[k] else other).add(v)
            for region in op.regions:
                other |= _reads(region.ops)
        return frozenset(v for v in copied - other if v in _producers(program, ops))

    return program.memo_of(ops, ("copied_in_place", tuple(outputs)), compute)


def _producers(program: Program, ops: Sequence[Op]) -> Mapping[int, int]:
    """value id -> position in ``ops`` of the op that makes it (values made outside: absent)."""
    return program.memo_of(ops, ("producers",), lambda: {v: i for i, op in enumerate(ops) for v in op.outputs})


@dataclasses.dataclass(frozen=True)
class _Liveness:
    """What :func:`temp_peak` reads off the program alone: each materialized temporary as
    (value, first op, last op), the ops that run bodies as (position, regions), and each op's
    position (by op id)."""

    ops: Sequence[Op]
    values: tuple[tuple[int, int, int], ...]
    regions: tuple[tuple[int, tuple], ...]
    index: Mapping[int, int]
    unfused: tuple[tuple[int, int, int, int], ...] = ()  # XLA:CPU: (first, last, value, copies) of buffers it adds


def _liveness(
    program: Program, ops: Sequence[Op], outputs: Sequence[int], conv_copies: bool = False, cpu: bool = False,
    library: frozenset[int] = frozenset(), windowed: frozenset[int] = frozenset(),
    collected: frozenset[int] = frozenset(), consumers: tuple[tuple[int, tuple[int, ...]], ...] = (),
) -> _Liveness:
    """``conv_copies``: a convolution reads a transposed copy of each operand XLA:CPU transposes
    (:func:`automap.cost.xla_cpu.conv_layout_copies`), not the operand itself (the copy's span is
    :func:`automap.cost.xla_cpu.cpu_spans`'); ``cpu``: XLA:CPU's fusions, which leave some of a
    reduction's operands outside (:func:`automap.cost.unfused_operands.unfused_reduction_operands`
    of the reductions at positions ``library``; the operand of each reduction at positions
    ``windowed``, a buffer that a reduce-window reads: :func:`automap.cost.xla_cpu.windowed_reductions`),
    and its threefry, which holds random bits as two uint32 halves. ``collected``: values a
    collective reads (stored: :func:`materialized`); ``consumers``: the ops each library
    fusion takes in below its reduction (:func:`automap.cost.unfused_operands.library_consumers`)."""
    key = ("liveness", id(ops), tuple(outputs), conv_copies, cpu, library, windowed, collected, consumers)
    got = program.memo.get(key)
    if got is not None and got.ops is ops:
        return got
    keep = set(program.memo_of(ops, ("materialized", tuple(outputs), collected),
                               lambda: frozenset(materialized(ops, outputs, collected))))
    unfused: tuple[tuple[int, int, int, int], ...] = ()
    if cpu:
        cuts, spread = unfused_reduction_operands(program, ops, keep, library, dict(consumers))
        keep |= cuts | {ops[i].inputs[0] for i in windowed}
        unfused = tuple((s, e, v, 1) for s, e, v in spread)
    out_set = set(outputs)
    own_copies = _copied_in_place(program, ops, outputs) if conv_copies else frozenset()
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.outputs:
            if v in keep and v not in out_set and v not in start:
                start[v] = i
        copied = conv_layout_copies(op, program)[:2] if conv_copies else ()
        unread = op.unread_operands if op.regions else frozenset()
        for k, v in enumerate(op.inputs):
            if (not (k < len(copied) and copied[k]) or v in own_copies) and v not in unread:
                end[v] = i
        for region in op.regions:  # outer values read inside the body stay live for the whole op
            for inner in _reads(region.ops):
                end[inner] = i
    beside_dots = recomputed_beside_dots(program, ops, outputs) if cpu else {}
    needed = {v: end.get(v, i) for v, i in beside_dots.items()}  # stored until its last dot, needed longer
    end.update(beside_dots)
    for i in range(len(ops) - 1, -1, -1):  # a fused result is recomputed where it is read: its
        fused = [v for v in ops[i].outputs if v not in keep]  # operands live until its last reader
        last = max([end.get(v, i) for v in fused] + [needed[v] for v in ops[i].outputs if v in needed], default=None)
        if last is not None:
            for v in ops[i].inputs:
                if v in needed:
                    needed[v] = max(needed[v], last)
                else:
                    end[v] = max(end.get(v, i), last)
    for i, op in enumerate(ops):  # an update written into its operand's buffer: the operand ends before it
        v = op.inputs[0] if op.inputs and traits_of(op.primitive).in_place else None
        if v in start and start[v] < i and end.get(v) == i:
            end[v] = i - 1
    values = tuple((v, s, max(end.get(v, s), s)) for v, s in start.items())
    if cpu:  # threefry's two uint32 halves, combined in each reader: held while the bits are read
        bits = {v: (s, e) for v, s, e in values}
        unfused += tuple((*bits[v], v, 2 * 4 // program.values[v].itemsize - 1) for v in
                         (op.outputs[0] for op in ops if op.primitive == "random_bits") if v in bits)
    regions = tuple((i, op.regions) for i, op in enumerate(ops) if op.regions)
    index = program.memo_of(ops, ("op_index",), lambda: {op.id: i for i, op in enumerate(ops)})
    got = _Liveness(ops, values, regions, index, unfused)
    if isinstance(ops, tuple):  # immutable: safe to reuse while the memo holds it
        program.memo[key] = got
    return got


def _workspaces(program: Program, ops: Sequence[Op], platform: str | None = None) -> list[tuple[int, Op, int]]:
    """(position, op, global bytes) of the ops in ``ops`` whose traits declare a workspace on
    ``platform``: the temporaries XLA's expansion of the op holds while it runs."""
    def compute() -> list[tuple[int, Op, int]]:
        out = []
        for i, op in enumerate(ops):
            fn = traits_of(op.primitive).workspace_on(platform)
            if fn is not None and op.outputs:
                out.append((i, op, fn(context(program, op), **op.params)))
        return out

    return program.memo_of(ops, ("workspaces", platform), compute)


def _reads(ops: Sequence[Op]) -> set[int]:
    out: set[int] = set()
    for op in ops:
        out.update(op.inputs)
        for region in op.regions:
            out |= _reads(region.ops)
    return out


def estimate_memory(
    state: ShardingState, *, donated: Iterable[int] = (), reshards: Iterable[Reshard] | None = None,
    platform: str | None = None,
) -> MemoryEstimate:
    """Per-device memory of the partitioned program (``donated``: input value ids given up;
    ``platform``: the buffers its compiler adds, ``"cpu"``: :mod:`automap.cost.xla_cpu`).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((8, 4)), jnp.ones((4, 2))), ["x", "w"], ["y"])
    >>> estimate_memory(ShardingState.initial(prog, {"data": 2})).peak  # 128 + 32 in, 64 out, dot result 64
    288
    """
    all_of_them = list(all_reshards(state) if reshards is None else reshards)
    state, all_of_them = inline_unrolled_scans(state, all_of_them)
    program = state.program
    size = _sizer(state)
    arguments = sum(map(size, dict.fromkeys(program.inputs)))
    outs = list(dict.fromkeys(program.outputs))
    outputs = sum(map(size, outs))
    donated = set(donated)
    aliased = 0
    free: dict[int, collections.deque[int]] = {}  # bytes -> donated inputs of that size, in input order
    for v in dict.fromkeys(program.inputs):
        if v in donated:
            free.setdefault(size(v), collections.deque()).append(v)
    own: list[tuple[int, int]] = []  # (op id writing it (-1: an input passed through), bytes): own buffers
    producer = program.memo.get("producer_of")
    if producer is None:
        producer = program.memo["producer_of"] = {v: op.id for op in program.ops for v in op.outputs}
    for v in outs:  # an output may reuse a donated input buffer of the same size (the first one left)
        nbytes = size(v)
        if free.get(nbytes):
            aliased += nbytes
            free[nbytes].popleft()
        else:
            own.append((producer.get(v, -1), nbytes))
    by_op: dict[int, list[Reshard]] = {}
    for r in all_of_them:
        by_op.setdefault(r.op, []).append(r)
    # an output's buffer holds temporaries until the output is written: the temp is what does not fit
    temp = temp_peak(program, state, program.ops, outs, by_op, own, platform=platform)
    return MemoryEstimate(arguments, outputs, aliased, temp)


def _sizer(state: ShardingState) -> Callable[[int], int]:
    """value id -> its bytes per device (``state.bytes_per_device``, with the shard count of
    each distinct spec computed once)."""
    specs, sizes, values = state.specs, state.axes, state.program.values
    shards: dict = {}

    def size(v: int) -> int:
        spec = specs.get(v)
        if spec is None:
            return values[v].nbytes
        n = shards.get(spec)
        if n is None:
            n = shards[spec] = math.prod(sizes[a] for dim in spec for a in dim)
        return values[v].nbytes // n

    return size
