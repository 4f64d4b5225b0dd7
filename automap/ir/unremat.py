"""Dropping a user's remat: the backward's recomputed forward matched to the forward that made it.

After ``jax.grad``, a block under ``jax.checkpoint`` / ``nn.remat`` keeps only its inputs for the
backward: the backward's checkpoint call (its ops carry the call in ``Op.remat``) recomputes the
block's forward from them, then runs the block's backward. :func:`drop_remat` undoes that, the
exact inverse of :func:`automap.ir.recompute.recompute`'s clones: a structural common
subexpression elimination of the recomputed ops against the ops that computed the same thing
(the same primitive and parameters, operands that are the same values, equal literals or values
already matched). Each recomputed op so matched is removed and its readers read the forward's
value; the checkpoint calls are dropped (no ``jax.checkpoint`` is emitted around what is left).
What has no match stays in the backward (the linearisation coefficients JAX computes in the
forward of a model without remat, e.g. ``1 - tanh(x)²``, are computed there from the forward's
values).

In a scanned stack of layers (``nn.scan(nn.remat(Block))``) the recomputation sits in the
backward ``scan``'s body and the forward in the forward ``scan``'s: a matched value of the forward
body is emitted by the forward scan, stacked over the layers, and read by the backward scan per
layer (as a model without remat keeps its residuals); a matched loop-invariant value (the
attention mask) is passed to the backward scan as a constant.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> import collections
>>> block = lambda w, x: jnp.tanh(jnp.tanh(x @ w) @ w)
>>> def lowered(f):
...     return lower(jax.make_jaxpr(jax.value_and_grad(f))(jnp.ones((4, 4)), jnp.ones((2, 4))), ["w", "x"], ["l", "g"])
>>> prog = lowered(lambda w, x: jax.checkpoint(block)(w, x).sum())
>>> plain = lowered(lambda w, x: block(w, x).sum())
>>> new = drop_remat(prog)
>>> len(prog.remat_calls), len(new.remat_calls), new.dropped_remat
(1, 0, 1)
>>> counts = lambda p: sorted(collections.Counter(op.primitive for op in p.all_ops).items())
>>> counts(new) == counts(plain) != counts(prog)
True
"""
from __future__ import annotations

import collections
import dataclasses
from typing import Any, Hashable

import numpy as np

from automap.ir.build import ProgramBuilder
from automap.ir.lower import dead_code_eliminated
from automap.ir.program import Op, Program, Region
from automap.ir.recompute import on_program
from automap.ir.scan_recompute import scan_op
from automap.shardings import ShardingState

__all__ = ["drop_remat", "drop_remat_state", "has_user_remat"]


def has_user_remat(program: Program) -> bool:
    """Whether the program holds a user's ``remat``/``checkpoint`` call automap could drop.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda x: jax.checkpoint(jnp.sin)(x).sum()
    >>> has_user_remat(lower(jax.make_jaxpr(jax.grad(f))(jnp.ones(4)), ["x"], ["g"]))
    True
    """
    return bool(program.remat_calls)


def _literal_key(value: Any) -> Hashable:
    try:
        a = np.asarray(value)
        return ("lit", a.shape, str(a.dtype), a.tobytes())
    except (TypeError, ValueError):  # a PRNG key or another extended dtype: only itself
        return ("obj", id(value))


def _params_key(params: Any) -> Hashable:
    items = tuple(sorted(params.items()))
    try:
        hash(items)
        return items
    except TypeError:  # arrays among the params: compare their text
        return repr(items)


class _Table:
    """Op keys (primitive, params, operand keys) -> the keys of the results of the first op with it."""

    def __init__(self, program: Program):
        self.values = program.values
        self.made: dict[Hashable, tuple[Hashable, ...]] = {}

    def operand(self, v: int, env: dict[int, Hashable], default: Any) -> Hashable:
        if v in env:
            return env[v]
        value = self.values[v]
        if value.kind in ("literal", "const"):
            return _literal_key(value.literal)
        return default(v)

    def key(self, op: Op, env: dict[int, Hashable], default: Any) -> Hashable | None:
        if op.regions or (op.eqn is not None and getattr(op.eqn, "effects", None)):
            return None  # control flow and effects are never merged
        return (op.primitive, _params_key(op.params), tuple(self.operand(v, env, default) for v in op.inputs))


def _outer(v: int) -> Hashable:
    return ("outer", v)


def drop_remat(program: Program) -> Program:
    """``program`` without its user's remat calls (module docstring); the same program if it has none.
    The result counts the calls dropped in ``dropped_remat``; it is made once per program (kept in
    ``program.memo``: the states of one search share it)."""
    if not program.remat_calls:
        return program
    got = program.memo.get("unremat")
    if got is None:
        got = program.memo["unremat"] = _dropped(program)
    return got


def _dropped(program: Program) -> Program:
    b = ProgramBuilder(program, "unremat")
    table = _Table(program)
    env: dict[int, Hashable] = {}
    renamed: dict[int, int] = {}  # a removed recomputed value -> the forward value read instead
    ops: list[Op] = []
    for op in program.ops:
        if renamed:
            op = _reading(op, renamed)
        key = table.key(op, env, _outer)
        got = table.made.get(key) if key is not None else None
        if got is not None:  # the same value as an earlier op's (a recomputation, or twice the same mask)
            env.update(zip(op.outputs, got, strict=True))
            if op.remat:  # recomputed: read the forward's results
                renamed.update((o, g[1]) for o, g in zip(op.outputs, got, strict=True))
                continue
        elif key is not None:
            table.made[key] = tuple(_outer(o) for o in op.outputs)
        ops.append(op)
    ops = _unscanned(program, b, ops, table, env)
    outputs = tuple(renamed.get(v, v) for v in program.outputs)
    ops = [_no_remat(op) for op in ops]
    ops = dead_code_eliminated(ops, set(outputs))
    return dataclasses.replace(
        program, values=tuple(b.values), ops=tuple(ops), outputs=outputs, remat_calls={},
        copies=b.copies, dropped_remat=program.dropped_remat + len(program.remat_calls), memo={},
    )


def drop_remat_state(state: ShardingState) -> ShardingState:
    """``state`` on :func:`drop_remat`'s program (the values it adds copy the layouts of those they
    stand for); ``state`` itself if the program has no user remat.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda w, x: jax.checkpoint(lambda w, x: jnp.tanh(x @ w))(w, x).sum()
    >>> prog = lower(jax.make_jaxpr(jax.grad(f))(jnp.ones((4, 4)), jnp.ones((2, 4))), ["w", "x"], ["g"])
    >>> state = ShardingState.initial(prog, {"data": 2})
    >>> dropped = drop_remat_state(state)
    >>> dropped.program is drop_remat(prog), dropped.program.dropped_remat, drop_remat_state(dropped) is dropped
    (True, 1, True)
    """
    program = drop_remat(state.program)
    return state if program is state.program else on_program(state, program)


def _reading(op: Op, renamed: dict[int, int]) -> Op:
    if not any(v in renamed for v in op.linked_inputs):
        return op
    return dataclasses.replace(op, inputs=tuple(renamed.get(v, v) for v in op.inputs),
                               linked_inputs=tuple(renamed.get(v, v) for v in op.linked_inputs))


def _no_remat(op: Op) -> Op:
    regions = tuple(dataclasses.replace(r, ops=tuple(_no_remat(o) for o in r.ops)) for r in op.regions)
    if not op.remat and regions == op.regions:
        return op
    return dataclasses.replace(op, remat=(), regions=regions)


def _unscanned(program: Program, b: ProgramBuilder, ops: list[Op], table: _Table,
               env: dict[int, Hashable]) -> list[Op]:
    """Each backward ``scan`` whose body recomputes (remat ops) matched against the forward
    ``scan`` whose stacked results it reads (module docstring)."""
    ops = list(ops)
    for j, bwd in enumerate(ops):
        if bwd.primitive != "scan" or not any(o.remat for o in bwd.regions[0].ops):
            continue
        ncb, nkb = bwd.params["num_consts"], bwd.params["num_carry"]
        xs = set(bwd.inputs[ncb + nkb:])
        i = next((i for i in range(j) if ops[i].primitive == "scan" and xs & set(ops[i].outputs)), None)
        if i is None:
            continue
        ops[i], ops[j] = _matched_pair(program, b, ops[i], bwd, table, env)
    return _pruned(b, ops, set(program.outputs))


def _matched_pair(program: Program, b: ProgramBuilder, fwd: Op, bwd: Op, table: _Table,
                  env: dict[int, Hashable]) -> tuple[Op, Op]:
    """The forward and backward scans with the backward body's recomputed ops matched (``env``:
    the keys of top-level values that equal earlier ones)."""
    rf, rb = fwd.regions[0], bwd.regions[0]
    ncf, nkf = fwd.params["num_consts"], fwd.params["num_carry"]
    ncb, nkb = bwd.params["num_consts"], bwd.params["num_carry"]
    # keys of the forward body's values: constants by their outer value, stacked inputs by theirs
    fenv: dict[int, Hashable] = {}
    for k, v in enumerate(rf.inputs):
        if k < ncf:
            fenv[v] = table.operand(fwd.inputs[k], env, _outer)
        elif k >= ncf + nkf:
            fenv[v] = ("xs", fwd.inputs[k])
    ftable = _Table(program)
    ftable.made = dict(table.made)  # loop-invariant work hoisted out of the forward (a mask) matches too
    for op in rf.ops:
        key = ftable.key(op, fenv, lambda v: ("f", v))
        if key in ftable.made:
            fenv.update(zip(op.outputs, ftable.made[key], strict=True))
        elif key is not None:
            ftable.made[key] = tuple(("f", o) for o in op.outputs)
    stacked = {o: ftable.operand(r, fenv, lambda v: ("f", v))
               for o, r in zip(fwd.outputs[nkf:], rf.outputs[nkf:], strict=True)}
    benv: dict[int, Hashable] = {}
    for k, (o, r) in enumerate(zip(bwd.inputs, rb.inputs, strict=True)):
        if k < ncb:
            benv[r] = table.operand(o, env, _outer)
        elif k >= ncb + nkb:
            benv[r] = stacked.get(o, ("xs", o))
    body: list[Op] = []
    renamed: dict[int, Hashable] = {}
    for op in rb.ops:
        key = ftable.key(op, benv, lambda v: ("b", v))
        got = ftable.made.get(key) if key is not None else None
        if op.remat and got is not None:
            benv.update(zip(op.outputs, got, strict=True))
            renamed.update(zip(op.outputs, got, strict=True))
            continue
        if got is not None:
            benv.update(zip(op.outputs, got, strict=True))
        else:
            benv.update((o, ("b", o)) for o in op.outputs)
            if key is not None:
                ftable.made[key] = tuple(("b", o) for o in op.outputs)
        body.append(op)

    # what the backward body reads of the removed ops: backward scan inputs
    consts = {table.operand(o, env, _outer): r for o, r in zip(bwd.inputs[:ncb], rb.inputs[:ncb], strict=True)}
    xs_in = {benv[r]: r for r in rb.inputs[ncb + nkb:]}
    emitted = {key: o for o, key in stacked.items()}  # forward body value key -> its stacked result
    new_consts: list[tuple[int, int]] = []  # (outer operand, body input)
    new_xs: list[tuple[int, int]] = []
    f_outs: list[tuple[int, int]] = []  # (forward body value, its new stacked result)
    length = fwd.params["length"]

    def body_value(key: Hashable, like: int) -> int:
        kind, v = key[0], key[1]
        if kind == "b":
            return v
        if kind == "outer":
            if key not in consts:
                consts[key] = b.value(v, program.values[v].name, region=rb.id, kind="region_input")
                new_consts.append((v, consts[key]))
            return consts[key]
        if key not in xs_in:
            if kind == "xs":
                outer = v
            elif key in emitted:
                outer = emitted[key]
            else:  # a forward body value: emitted stacked by the forward scan
                outer = b.value(v, f"{fwd.name}/residual", shape=(length, *program.values[v].shape), phase="forward")
                f_outs.append((v, outer))
                emitted[key] = outer
            xs_in[key] = b.value(like, program.values[like].name, region=rb.id, kind="region_input")
            new_xs.append((outer, xs_in[key]))
        return xs_in[key]

    swap = {v: body_value(key, v) for v, key in renamed.items()
            if any(v in op.inputs for op in body) or v in rb.outputs}
    body = [_reading(op, swap) for op in body]
    b_ins = (list(bwd.inputs[:ncb]) + [o for o, _ in new_consts] + list(bwd.inputs[ncb:]) + [o for o, _ in new_xs])
    b_body = Region(rb.id, tuple(rb.inputs[:ncb]) + tuple(r for _, r in new_consts) + tuple(rb.inputs[ncb:])
                    + tuple(r for _, r in new_xs), tuple(swap.get(v, v) for v in rb.outputs), tuple(body),
                    rb.trips, rb.role)
    b_params = dict(bwd.params, num_consts=ncb + len(new_consts), linear=(False,) * len(b_ins), jaxpr=None)
    new_bwd = scan_op(b, bwd, b_ins, list(bwd.outputs), b_body, b_params)
    f_body = dataclasses.replace(rf, outputs=rf.outputs + tuple(v for v, _ in f_outs))
    new_fwd = scan_op(b, fwd, list(fwd.inputs), list(fwd.outputs) + [y for _, y in f_outs], f_body,
                       dict(fwd.params, jaxpr=None))
    return new_fwd, new_bwd


def _pruned(b: ProgramBuilder, ops: list[Op], live: set[int]) -> list[Op]:
    """``ops`` with each ``scan``'s stacked results that nothing reads dropped (and its body's work
    for them): a residual the backward recomputed once, now read from elsewhere."""
    read = collections.Counter(v for op in ops for v in op.inputs) + collections.Counter(live)
    out = []
    for op in ops:
        if op.primitive == "scan":
            nk = op.params["num_carry"]
            r = op.regions[0]
            keep = [m for m in range(nk, len(op.outputs)) if read[op.outputs[m]]]
            if len(keep) < len(op.outputs) - nk:
                outs = list(op.outputs[:nk]) + [op.outputs[m] for m in keep]
                body_outs = tuple(r.outputs[:nk]) + tuple(r.outputs[m] for m in keep)
                body = Region(r.id, r.inputs, body_outs, tuple(dead_code_eliminated(list(r.ops), set(body_outs))),
                              r.trips, r.role)
                op = scan_op(b, op, list(op.inputs), outs, body, dict(op.params, jaxpr=None))
        out.append(op)
    return out

