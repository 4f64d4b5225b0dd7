"""Fully unrolled scans, laid out as the straight-line code XLA compiles them to.

A ``scan`` whose ``unroll`` covers its ``length`` (``jax.lax.fori_loop(..., unroll=True)``, as optax's
Newton-Schulz steps in Muon) is no loop in XLA: each trip is a copy of the body, fused and scheduled
with the others, so a value one trip makes can stay live across the next ones (XLA:CPU recomputes a
cheap carry in the next trip's fusions: :func:`automap.cost.xla_cpu.recomputed_beside_dots`). The
memory estimate walks such a scan as ``length`` copies of its body in sequence
(:func:`inline_unrolled_scans`); a scan that stays a loop keeps its body, priced once.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
from typing import Mapping, Sequence

from automap.analysis import Reshard
from automap.ir.program import Op, Program
from automap.shardings import ShardingState


def fully_unrolled(op: Op) -> bool:
    """A top-level ``scan`` XLA compiles without a loop (one trip is no loop either), whose trips
    read no slices and stack no results (carries and constants only) and whose body holds no
    control flow.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> steps = lambda unroll: lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y @ y, x, unroll=unroll)
    >>> [fully_unrolled(lower(jax.make_jaxpr(steps(u))(jnp.ones((4, 4))), ["x"], ["y"]).ops[-1]) for u in (True, 1)]
    [True, False]
    """
    if op.primitive != "scan":
        return False
    p = op.params
    unroll = p.get("unroll", 1)
    length = int(p["length"])
    (body,) = op.regions
    return ((unroll is True or int(unroll) >= length)
            and len(op.inputs) == p["num_consts"] + p["num_carry"] == len(body.inputs)
            and len(op.outputs) == p["num_carry"] and not any(o.regions for o in body.ops))


def inline_unrolled_scans(state: ShardingState, reshards: Sequence[Reshard]) -> tuple[ShardingState, list[Reshard]]:
    """``state`` and ``reshards`` with each :func:`fully_unrolled` scan of its program replaced by
    ``length`` copies of its body (fresh values with the specs of the body's), each reshard at a
    body op going with each copy of it, once a trip (a split sum's all-reduce: Muon's kernels
    with their columns on 'model', 0.62 -> 0.94x XLA's memory under megatron_dp); unchanged where
    there is none, or where a reshard sits on the scan or on an operand in its body (a gather
    of what the loop works on: under Muon's FSDP plans XLA's temp stays near one trip's, 0.9-1.1x
    the loop's estimate, where the copies, each with its gathers, came to 1.9-2.1x).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> steps = lambda x: jax.lax.fori_loop(0, 3, lambda i, y: y @ y, x, unroll=True)
    >>> prog = lower(jax.make_jaxpr(steps)(jnp.ones((4, 4))), ["x"], ["y"])
    >>> inlined, _ = inline_unrolled_scans(ShardingState.initial(prog, {"data": 2, "model": 4}), [])
    >>> [op.primitive for op in prog.ops], [op.primitive for op in inlined.program.ops if op.primitive == "dot_general"]
    (['scan'], ['dot_general', 'dot_general', 'dot_general'])
    """
    program = state.program
    scans = program.memo_of(program.ops, ("unrolled_scans",),
                            lambda: frozenset(op.id for op in program.ops if fully_unrolled(op)))
    inside = {o.id for op in program.ops if op.id in scans for o in op.regions[0].ops}
    if not scans or any(r.op in scans or (r.op in inside and r.where == "operand") for r in reshards):
        return state, list(reshards)
    inlined, origin, trips = program.memo_of(program.ops, ("unrolled_inlined",), lambda: _inline(program, scans))
    specs = dict(state.specs)
    specs.update({new: specs[old] for new, old in origin.items() if old in specs})
    return state.replace(program=inlined, specs=specs), _copied_reshards(reshards, trips)


def _copied_reshards(reshards: Sequence[Reshard], trips: Mapping[int, list[tuple[int, Mapping[int, int]]]],
                     ) -> list[Reshard]:
    """``reshards`` with each one at a body op repeated at that op's copies (one trip each), on
    the copy of its value."""
    out: list[Reshard] = []
    for r in reshards:
        copies = trips.get(r.op)
        if copies is None:
            out.append(r)
            continue
        once = max(r.count // len(copies), 1)
        out.extend(dataclasses.replace(r, op=op, value=renamed.get(r.value, r.value), count=once)
                   for op, renamed in copies)
    return out


def _inline(program: Program, scans: frozenset[int]) -> tuple[Program, dict[int, int], dict[int, list]]:
    """(the program with ``scans`` inlined, new value id -> the body value it copies, body op id
    -> its copies: (op id, body value -> the trip's value) per trip)."""
    values = list(program.values)
    fresh_op = itertools.count(max(op.id for op in program.all_ops) + 1)
    origin: dict[int, int] = {}
    alias: dict[int, int] = {}  # a scan's result -> the last copy's value
    ops: list[Op] = []
    trips: dict[int, list[tuple[int, Mapping[int, int]]]] = {}
    for op in program.ops:
        if op.id not in scans:
            ops.append(_renamed(op, alias) if alias else op)
            continue
        (body,) = op.regions
        nc = op.params["num_consts"]
        env = dict(zip(body.inputs, (alias.get(v, v) for v in op.inputs)))
        for _ in range(int(op.params["length"])):
            made: dict[int, int] = {}
            renamed = collections.ChainMap(made, dict(env))
            for inner in body.ops:
                outs = []
                for v in inner.outputs:
                    made[v] = len(values)
                    origin[len(values)] = v
                    values.append(dataclasses.replace(values[v], id=len(values), region=0))
                    outs.append(made[v])
                inputs = tuple(made.get(v, env.get(v, v)) for v in inner.inputs)
                new = dataclasses.replace(inner, id=next(fresh_op), inputs=inputs, outputs=tuple(outs),
                                          linked_inputs=(), linked_outputs=())
                ops.append(new)
                trips.setdefault(inner.id, []).append((new.id, renamed))
            carried = [made.get(v, env.get(v, v)) for v in body.outputs]
            env.update(zip(body.inputs[nc:], carried))
        alias.update(zip(op.outputs, carried))
    return (dataclasses.replace(program, values=tuple(values), ops=tuple(ops),
                                outputs=tuple(alias.get(v, v) for v in program.outputs), memo={}), origin, trips)


def _renamed(op: Op, alias: dict[int, int]) -> Op:
    """``op`` reading the values ``alias`` renames (inside its regions too)."""
    regions = tuple(dataclasses.replace(r, ops=tuple(_renamed(o, alias) for o in r.ops)) for r in op.regions)
    return dataclasses.replace(op, inputs=tuple(alias.get(v, v) for v in op.inputs), regions=regions)
