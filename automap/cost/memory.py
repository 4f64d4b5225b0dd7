"""Peak memory per device by liveness over the program order.

XLA reports ``argument + output - alias + temp`` per device; the estimate mirrors those terms:
arguments (every input, sharded), outputs, aliased (donated inputs whose buffer an output
reuses) and the peak of the live temporaries walking the ops in order. Only *materialized*
values count as temporaries: XLA fuses chains of elementwise work, so a value made by a fusible
op and read only by fusible ops or reductions never exists in memory. A ``scan`` adds the peak
of its body (one iteration) while it runs; its stacked outputs are ordinary values.
"""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

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
    delta = [0] * (len(ops) + 1)
    for v, s in start.items():
        e = max(end.get(v, s), s)
        size = state.bytes_per_device(v)
        delta[s] += size
        delta[e + 1] -= size
    copies: dict[tuple, list[int]] = {}  # (value, kind, axes) -> [first, last, bytes]
    for i, op in enumerate(ops):
        for r in reshards.get(op.id, ()):
            if r.where == "operand":
                got = copies.setdefault((r.value, r.kind, r.axes), [i, i, r.bytes])
                got[1] = i
            elif r.kind == "reduce-scatter":  # the partial result exists whole before it is scattered
                copies[(r.value, r.kind, r.axes, i)] = [i, i, r.bytes]
    for first, last, size in copies.values():
        delta[first] += size
        delta[last + 1] -= size
    peak = live = 0
    for i, op in enumerate(ops):
        live += delta[i]
        transient = 0
        for region in op.regions:
            transient = max(transient, temp_peak(program, state, region.ops, region.outputs, reshards))
        peak = max(peak, live + transient)
    return peak


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
    arguments = sum(state.bytes_per_device(v) for v in dict.fromkeys(program.inputs))
    outs = list(dict.fromkeys(program.outputs))
    outputs = sum(state.bytes_per_device(v) for v in outs)
    donated = set(donated)
    aliased = 0
    free = {v: state.bytes_per_device(v) for v in program.inputs if v in donated}
    for v in outs:  # an output may reuse a donated input buffer of the same size
        size = state.bytes_per_device(v)
        match = next((d for d, s in free.items() if s == size), None)
        if match is not None:
            aliased += size
            del free[match]
    by_op: dict[int, list[Reshard]] = {}
    for r in all_reshards(state) if reshards is None else reshards:
        by_op.setdefault(r.op, []).append(r)
    return MemoryEstimate(arguments, outputs, aliased, temp_peak(program, state, program.ops, outs, by_op))
