"""Values tied to the backward pass, so that XLA makes them there and not earlier.

XLA's scheduler places an op as soon as its operands are ready: a parameter gathered for the
forward (ZeRO-3) is gathered once and held until its backward readers are done, and a backward
gradient accumulator made of constant zeros (the scatter-add under an embedding's gradient) is
materialised at the start of the program and held through the forward. Tying such a value to a
backward value made just before it is needed (``x`` plus an exact zero computed from that value
reduced to a scalar: one scalar all-reduce where it is sharded, never a gather) leaves XLA no
choice. :func:`regather_inputs` does it for the parameters a recomputed block reads
(:mod:`automap.ir.recompute`: the clones and the later backward readers read the tied copy, gathered
again), :func:`late_zeros` for the constant zeros the backward reads.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> def loss(table, ids):
...     return jnp.tanh(table[ids]).sum()
>>> prog = lower(jax.make_jaxpr(jax.grad(loss))(jnp.ones((64, 32)), jnp.zeros((8,), jnp.int32)), ["t", "i"], ["g"])
>>> late = late_zeros(prog)
>>> len(late.ops) - len(prog.ops), late_zeros(late) is late   # the tie's max, !=, convert, mul, add: once
(5, True)
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import jax

from automap.ir.build import ProgramBuilder, call_start, calls_reading
from automap.ir.program import Op, Program, Value

LATE = "/late"  # the name suffix of the ops that tie a value to the backward
MIN_ZEROS_BYTES = 1024  # smaller constant zeros are left where they are (each tie is a scalar all-reduce)


def tied(x: jax.Array, after: jax.Array) -> jax.Array:
    """``x`` plus an exact zero computed from ``after`` reduced to a scalar (a NaN in ``after``
    still adds zero): the same numbers, made after ``after``; the reduction, not a reshape, keeps
    a sharded ``after`` from being gathered.

    >>> import jax.numpy as jnp
    >>> tied(jnp.arange(3.0), jnp.array([[1.0, jnp.nan]]))
    Array([0., 1., 2.], dtype=float32)
    """
    m = after.max()
    return x + (m != m).astype(x.dtype) * jax.numpy.zeros((), x.dtype)


def latest_backward(program: Program, at: int, accept: Callable[[int, Value], bool]) -> int | None:
    """The latest value made by a backward op before position ``at`` that ``accept(id, value)``
    takes, if the backward has begun by then (None once a forward op is met). :func:`tie` takes
    any floating value of rank >= 1; :mod:`automap.ir.recompute` one of a residual's shape."""
    for op in reversed(program.ops[:at]):
        if op.phase != "backward":
            return None
        for v in op.outputs:
            if accept(v, program.values[v]):
                return v
    return None


def tie(builder: ProgramBuilder, program: Program, v: int, at: int) -> int:
    """``v`` tied (:func:`tied`) to the latest backward value before position ``at``, traced into
    ``builder``; ``v`` itself where the backward has not begun there."""
    after = latest_backward(program, at, lambda u, value: u != v and value.ndim >= 1
                            and jax.numpy.issubdtype(value.dtype, jax.numpy.floating))
    return v if after is None else builder.trace(tied, [v, after], [v])[-1]


def regather_inputs(builder: ProgramBuilder, program: Program, inputs: tuple[int, ...], at: int) -> dict[int, int]:
    """Of ``inputs`` (what a recomputed block's clones read), the program inputs (parameters)
    tied to the backward before position ``at``: input -> its tied copy."""
    got = {}
    for v in inputs:
        if program.values[v].kind == "input":
            t = tie(builder, program, v, at)
            if t != v:
                got[v] = t
    return got


def _zeros(program: Program) -> list[tuple[int, Op]]:
    """(position of its first reader, or of the start of the user's remat call holding it, op) of
    each backward broadcast of a constant of at least :data:`MIN_ZEROS_BYTES` not tied yet (and
    not made inside such a call)."""
    first: dict[int, int] = {}
    tied_already = set()
    for i, op in enumerate(program.ops):
        for v in op.inputs:
            first.setdefault(v, i)
            if op.name.endswith(LATE):
                tied_already.add(v)
    found = []
    for op in program.ops:
        if (op.phase == "backward" and op.primitive == "broadcast_in_dim" and not op.regions and not op.remat
                and all(program.values[v].kind in ("literal", "const") for v in op.inputs)):
            out = program.values[op.outputs[0]]
            if (math.prod(out.shape) * out.dtype.itemsize >= MIN_ZEROS_BYTES and op.outputs[0] in first
                    and op.outputs[0] not in tied_already):  # tied before a user's remat call reading it
                found.append((call_start(program.ops, first[op.outputs[0]]), op))
    return found


def late_zeros(program: Program) -> Program:
    """``program`` with each constant broadcast the backward reads (:func:`_zeros`) tied to the
    backward value made just before its first reader, and its readers reading the tied copy."""
    for at, op in sorted(_zeros(program), key=lambda t: -t[0]):  # last first: earlier positions stay valid
        z = op.outputs[0]
        builder = ProgramBuilder(program, op.name + LATE)
        t = tie(builder, program, z, at)
        if t == z:
            continue
        rest, read = [], []
        for reader in program.ops[at:]:
            if z in reader.inputs:
                reader = dataclasses.replace(reader, inputs=tuple(t if v == z else v for v in reader.inputs),
                                             linked_inputs=tuple(t if v == z else v for v in reader.linked_inputs))
                read.append(reader)
            rest.append(reader)
        ops = program.ops[:at] + tuple(builder.ops) + tuple(rest)
        program = dataclasses.replace(program, values=tuple(builder.values), ops=ops, copies=builder.copies,
                                      memo={}, remat_calls=calls_reading(program.remat_calls, read, {z: t}))
    return program
