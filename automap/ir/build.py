"""Building on a lowered program: new values and ops appended to a copy of its tables (the
recomputation passes of :mod:`automap.ir.recompute` and :mod:`automap.ir.scan_recompute`), and
the user's remat calls kept whole and reading what their ops read after a rewrite renames it."""
from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import jax

from automap import _compat
from automap.ir.program import Op, Program, RematCall, Value
from automap.rules import registry
from automap.rules.registry import RuleContext, Shaped


class ProgramBuilder:
    """Appends values and ops to a program under construction."""

    def __init__(self, program: Program, block: str):
        self.values = list(program.values)
        self.copies = dict(program.copies)
        self.next_op = max(op.id for op in program.all_ops) + 1
        self.block = block
        self.ops: list[Op] = []

    def value(self, like: int, name: str, literal: object = None, region: int = 0, shape: tuple | None = None,
              kind: str = "intermediate", phase: str = "backward") -> int:
        """A new value copying ``like``'s layout (recorded in ``copies``; with ``shape`` one dim
        longer: ``like`` stacked, a new leading dim in front)."""
        v = dataclasses.replace(self.values[like], id=len(self.values), name=name, region=region, literal=literal,
                                kind="literal" if literal is not None else kind, phase=phase,
                                shape=self.values[like].shape if shape is None else tuple(shape))
        self.values.append(v)
        if literal is None:
            self.copies[v.id] = self.copies.get(like, like)
        return v.id

    def trace(self, fn, ins: Sequence[int], likes: Sequence[int]) -> list[int]:
        """Ops computing ``fn`` of the values ``ins``; each result (intermediate ones too) copies
        the layout of the value of ``likes`` with its shape (the last of them that has it)."""
        shaped = [jax.ShapeDtypeStruct(self.values[v].shape, self.values[v].dtype) for v in ins]
        closed = jax.make_jaxpr(fn)(*shaped)
        env = dict(zip(closed.jaxpr.invars, ins, strict=True))
        name = f"{self.block}/recompute"
        for eqn in closed.jaxpr.eqns:
            args = []
            for a in eqn.invars:
                if not _compat.is_literal(a):
                    args.append(env[a])
                else:  # a literal
                    args.append(len(self.values))
                    self.values.append(Value(len(self.values), (), a.aval.dtype, "literal", "literal", "backward",
                                             a.aval.dtype.itemsize, 0, a.val))
            outs = []
            for o in eqn.outvars:
                like = next((v for v in reversed(likes) if self.values[v].shape == tuple(o.aval.shape)), None)
                if like is None:  # a scalar, or a shape no value of ``likes`` has: replicated, its own shape
                    self.values.append(Value(len(self.values), tuple(o.aval.shape), o.aval.dtype, name,
                                             "intermediate", "backward", o.aval.dtype.itemsize))
                    outs.append(len(self.values) - 1)
                else:
                    outs.append(self.value(like, name))
                env[o] = outs[-1]
            ctx = RuleContext(eqn.primitive.name, tuple(Shaped(self.values[v].shape, self.values[v].dtype) for v in args),
                              tuple(Shaped(self.values[v].shape, self.values[v].dtype) for v in outs), "", name)
            rule, ok = registry.rule_for(ctx, eqn.params, strict=False, primitive=eqn.primitive)
            self.add(Op(0, eqn.primitive.name, tuple(args), tuple(outs), rule, self.block, "recompute", "backward",
                        dict(eqn.params), eqn, (), tuple(args), tuple(outs), ok))
        return [env[v] for v in closed.jaxpr.outvars]

    def add(self, op: Op) -> None:
        self.ops.append(dataclasses.replace(op, id=self.next_op))
        self.next_op += 1


def call_start(ops: Sequence[Op], at: int) -> int:
    """``at``, or where the user's remat call holding ``ops[at]`` begins: ops put in before that
    position leave the call's ops in one run (emission wraps each run in one ``jax.checkpoint``,
    whose body reads only the call's inputs).

    >>> ops = [Op(i, "sin", (i,), (i + 1,), None, "", "", "backward", {}, remat=r) for i, r in enumerate([(), (0,), (0,)])]
    >>> call_start(ops, 2), call_start(ops, 0)
    (1, 0)
    """
    if at >= len(ops) or not ops[at].remat:
        return at
    rid = ops[at].remat[0]
    while at > 0 and ops[at - 1].remat[:1] == (rid,):
        at -= 1
    return at


def calls_reading(calls: Mapping[int, RematCall], renamed_ops: Iterable[Op],
                  renamed: Mapping[int, int]) -> dict[int, RematCall]:
    """``calls`` with each call holding one of ``renamed_ops`` (ops whose operands a rewrite read
    through ``renamed``) taking the renamed values as its inputs too: the ops of a call read
    only its inputs (a recomputed scan's backward body, whose ``jax.checkpoint`` read a residual
    the rewrite replaced, otherwise read a value no longer made).

    >>> call = RematCall(0, (3, 4), (9,), {})
    >>> op = Op(5, "sin", (7,), (9,), None, "", "", "backward", {}, remat=(0,))
    >>> calls_reading({0: call}, [op], {3: 7})[0].inputs, calls_reading({0: call}, [], {3: 7})[0].inputs
    ((7, 4), (3, 4))
    """
    ids = {rid for op in renamed_ops for rid in op.remat}
    return {rid: dataclasses.replace(c, inputs=tuple(renamed.get(v, v) for v in c.inputs)) if rid in ids else c
            for rid, c in calls.items()}
