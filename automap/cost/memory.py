"""Peak memory per device by liveness over the program order.

XLA reports ``argument + output - alias + temp`` per device; the estimate mirrors those terms:
arguments (every input, sharded), outputs, aliased (donated inputs whose buffer an output
reuses) and the peak of the live temporaries walking the ops in order. Only *materialized*
values count as temporaries: XLA fuses chains of elementwise work, so a value made by a fusible
op and read only by fusible ops or reductions never exists in memory. A ``scan`` adds the peak
of its body (one iteration) while it runs; its stacked outputs are ordinary values.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import math
from typing import Callable, Iterable, Mapping, Sequence

from automap.ir.program import Op, Program
from automap.propagate import Reshard
from automap.propagate import reshards as all_reshards
from automap.shardings import ShardingState  # noqa: F401  (doctest)

# ops that XLA does not fuse into their consumers (their results are materialized buffers)
MATERIALIZING = frozenset({
    "dot_general", "conv_general_dilated", "gather", "scatter", "scatter-add", "scatter_add", "scatter_mul",
    "scatter_min", "scatter_max", "sort", "cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", "argmax",
    "argmin", "top_k", "scan", "cond", "while", "dynamic_update_slice", "random_bits", "reduce_sum", "reduce_max",
    "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor", "concatenate", "pad",
})
# consumers that read their operands from memory (a fusible producer feeding them materializes)
READS_MEMORY = MATERIALIZING - {"reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and",
                                "reduce_or", "reduce_xor", "concatenate", "pad"}


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


def materialized(ops: Sequence[Op], outputs: Iterable[int]) -> set[int]:
    """Values of ``ops`` that exist as buffers (see the module docstring)."""
    keep = set(outputs)
    for op in ops:
        if op.primitive in MATERIALIZING or op.regions:
            keep.update(op.outputs)
        if op.primitive in READS_MEMORY or op.regions:
            keep.update(op.inputs)
    return keep


def temp_peak(
    program: Program, state: ShardingState, ops: Sequence[Op], outputs: Sequence[int],
    reshards: Mapping[int, Sequence[Reshard]] = {},
) -> int:
    """Peak bytes of live materialized temporaries while ``ops`` run (outputs excluded).

    Resharded operands are temporaries too: a gathered parameter lives from its first use to
    its last (XLA gathers it once and keeps it), an all-to-all copy for the op that needs it."""
    live_ranges = _liveness(program, ops, outputs)
    delta = [0] * (len(ops) + 1)
    size = _sizer(state)
    for v, s, e in live_ranges.values:
        nbytes = size(v)
        delta[s] += nbytes
        delta[e + 1] -= nbytes
    copies: dict[tuple, list[int]] = {}  # (value, kind, axes) -> [first, last, bytes]
    index = live_ranges.index
    for i, rs in sorted((index[op], rs) for op, rs in reshards.items() if op in index):  # in program order
        for r in rs:
            if r.where == "operand":
                got = copies.setdefault((r.value, r.kind, r.axes), [i, i, r.bytes])
                got[1] = i
            elif r.kind == "reduce-scatter":  # the partial result exists whole before it is scattered
                copies[(r.value, r.kind, r.axes, i)] = [i, i, r.bytes]
    for first, last, nbytes in copies.values():
        delta[first] += nbytes
        delta[last + 1] -= nbytes
    live = list(itertools.accumulate(delta[: len(ops)]))  # after each op starts
    peak = max(max(live, default=0), 0)
    for i, regions in live_ranges.regions:  # a body's own peak while its op runs
        transient = max(temp_peak(program, state, r.ops, r.outputs, reshards) for r in regions)
        peak = max(peak, live[i] + transient)
    return peak


@dataclasses.dataclass(frozen=True)
class _Liveness:
    """What :func:`temp_peak` reads off the program alone: each materialized temporary as
    (value, first op, last op), the ops that run bodies as (position, regions), and each op's
    position (by op id)."""

    ops: Sequence[Op]
    values: tuple[tuple[int, int, int], ...]
    regions: tuple[tuple[int, tuple], ...]
    index: Mapping[int, int]


def _liveness(program: Program, ops: Sequence[Op], outputs: Sequence[int]) -> _Liveness:
    key = ("liveness", id(ops), tuple(outputs))
    got = program.memo.get(key)
    if got is not None and got.ops is ops:
        return got
    keep = materialized(ops, outputs)
    out_set = set(outputs)
    start: dict[int, int] = {}
    end: dict[int, int] = {}
    for i, op in enumerate(ops):
        for v in op.outputs:
            if v in keep and v not in out_set and v not in start:
                start[v] = i
        for v in op.inputs:
            end[v] = i
        for region in op.regions:  # outer values read inside the body stay live for the whole op
            for inner in _reads(region.ops):
                end[inner] = i
    values = tuple((v, s, max(end.get(v, s), s)) for v, s in start.items())
    regions = tuple((i, op.regions) for i, op in enumerate(ops) if op.regions)
    got = _Liveness(ops, values, regions, {op.id: i for i, op in enumerate(ops)})
    if isinstance(ops, tuple):  # immutable: safe to reuse while the memo holds it
        program.memo[key] = got
    return got


def _reads(ops: Sequence[Op]) -> set[int]:
    out: set[int] = set()
    for op in ops:
        out.update(op.inputs)
        for region in op.regions:
            out |= _reads(region.ops)
    return out


def estimate_memory(
    state: ShardingState, *, donated: Iterable[int] = (), reshards: Iterable[Reshard] | None = None
) -> MemoryEstimate:
    """Per-device memory of the partitioned program (``donated``: input value ids given up).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x, w: jnp.tanh(x @ w))(jnp.ones((8, 4)), jnp.ones((4, 2))), ["x", "w"], ["y"])
    >>> estimate_memory(ShardingState.initial(prog, {"data": 2})).peak  # 128 + 32 in, 64 out, dot result 64
    288
    """
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
    for v in outs:  # an output may reuse a donated input buffer of the same size (the first one left)
        nbytes = size(v)
        if free.get(nbytes):
            aliased += nbytes
            free[nbytes].popleft()
    by_op: dict[int, list[Reshard]] = {}
    for r in all_reshards(state) if reshards is None else reshards:
        by_op.setdefault(r.op, []).append(r)
    return MemoryEstimate(arguments, outputs, aliased, temp_peak(program, state, program.ops, outs, by_op))


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
