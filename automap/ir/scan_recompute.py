"""Activation recomputation in a scanned stack of layers: the backward scan recomputes its residuals.

``jax.grad`` of a ``scan`` over layers leaves two loops in the traced step: the forward scan,
whose body also emits every value the backward reads (its residuals, stacked over the layers:
all of them live from the forward to the backward, which is what the memory of a scanned
model goes to), and the backward scan, which reads them as its per-iteration inputs. To
recompute the block (what ``jax.checkpoint`` around the scan body does), :func:`recompute_scan`
rewrites the pair: the forward body emits, instead of its residuals, only the carry it was
given (the layer's input, stacked: the checkpoints); the backward body starts with clones of
the forward body's ops that make the residuals, reading the checkpoint, the forward's
per-layer inputs (the stacked parameters, passed to the backward too) and its constants. One
layer's residuals then live at a time, for one more run of the forward body per layer. The
recomputation sits in a different loop from the forward, so XLA cannot merge it back.

``save`` leaves some residuals stacked (:func:`dots_without_batch_dims`: the outputs of the
weight matmuls, as ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable`` and Megatron-LM's
selective recomputation keep them): the clones read them instead of recomputing them.

A block is the pair's forward body, named by its ops' common module path (``GPT/blocks``), or
by the scan's source line (``scan at gpt_nnx.py:145:19 (GPT.__call__)``).
Forward bodies holding control flow or a user's ``remat`` are left alone; a backward body's
``remat`` (``jax.checkpoint`` around the layer: the backward recomputes its forward from the
layer's input) reads the clones in place of the residuals it read.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> def loss(ws, x):
...     def layer(h, w):
...         with jax.named_scope("layer"):
...             return jnp.tanh(jnp.tanh(h @ w) @ w), None
...     return jax.lax.scan(layer, x, ws)[0].sum()
>>> prog = lower(jax.make_jaxpr(jax.grad(loss))(jnp.ones((3, 4, 4)), jnp.ones((2, 4))), ["ws", "x"], ["g"])
>>> list(scan_blocks(prog))
['layer']
>>> new = recompute_scan(prog, "layer")
>>> forward, backward = (op for op in new.ops if op.primitive == "scan")
>>> [new.values[v].shape for v in forward.outputs]  # the carry, and the carry of each layer (3 x [2, 4])
[(2, 4), (3, 2, 4)]
>>> sorted(op.primitive for op in backward.regions[0].ops if op.name.endswith("/recompute"))  # 1 - tanh² too
['dot_general', 'dot_general', 'sub', 'sub', 'tanh', 'tanh']
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from automap.ir.build import ProgramBuilder, calls_reading
from automap.ir.lower import dead_code_eliminated, link_rule
from automap.ir.program import Op, Program, Region

Saved = Callable[[Program, Op], bool]  # whether a forward body op's results stay stacked


@dataclasses.dataclass(frozen=True)
class ScanPair:
    """A forward scan and the backward scan that reads its stacked residuals (positions in
    ``program.ops``; ``residuals``: the forward's results only the backward reads)."""

    forward: int
    backward: int
    residuals: tuple[int, ...]


def _reads(ops) -> set[int]:
    return {v for op in ops for v in op.inputs}


def _plain(ops) -> bool:
    return not any(op.regions or op.remat for op in ops)


def scan_blocks(program: Program) -> dict[str, ScanPair]:
    """Block name (the forward body's common module path) -> its :class:`ScanPair`, for each
    top-level forward ``scan`` with a plain body whose stacked results a backward ``scan`` reads."""
    got = program.memo.get("scan_blocks")
    if got is not None:
        return got
    readers: dict[int, list[tuple[int, int]]] = {}  # value -> (op position, operand position)
    for i, op in enumerate(program.ops):
        for k, v in enumerate(op.inputs):
            readers.setdefault(v, []).append((i, k))
    outputs = set(program.outputs)
    out: dict[str, ScanPair] = {}
    for i, op in enumerate(program.ops):
        if op.primitive != "scan" or op.phase != "forward" or not _plain(op.regions[0].ops):
            continue
        nk = op.params["num_carry"]
        by: dict[int, list[int]] = {}
        for y in op.outputs[nk:]:
            rs = readers.get(y, [])
            if y in outputs or not rs or len({j for j, _ in rs}) > 1:
                continue
            j, k = rs[0]
            b = program.ops[j]
            if b.primitive == "scan" and b.phase == "backward" and k >= b.params["num_consts"] + b.params["num_carry"]:
                by.setdefault(j, []).append(y)
        if not by:
            continue
        j, ys = max(by.items(), key=lambda t: len(t[1]))
        names = [o.name.split("/") for o in op.regions[0].ops if o.name]
        common = [p[0] for p in zip(*names) if len(set(p)) == 1] if names else []
        where = op.source.rsplit("/", 1)[-1]  # no module path (a bare jax.lax.scan): the scan's source line
        name = "/".join(common) or op.name or (f"scan at {where}" if where else f"scan {op.id}")
        while name in out:
            name += "'"
        out[name] = ScanPair(i, j, tuple(ys))
    program.memo["scan_blocks"] = out
    return out


def dots_without_batch_dims(program: Program, op: Op) -> bool:
    """A weight matmul (a ``dot_general`` without batch dims): its result stays stacked under
    selective recomputation; attention's batched dots, softmax and the elementwise work are redone."""
    if op.primitive != "dot_general":
        return False
    (_, (lhs_batch, _)) = op.params["dimension_numbers"]
    return not lhs_batch


def recompute_scan(program: Program, block: str, save: Saved | None = None) -> Program:
    """``program`` with the scan block ``block`` (:func:`scan_blocks`) recomputed in the backward
    scan (module docstring); results of the forward body ops ``save`` names stay stacked."""
    pair = scan_blocks(program)[block]
    fwd, bwd = program.ops[pair.forward], program.ops[pair.backward]
    rf, rb = fwd.regions[0], bwd.regions[0]
    ncf, nkf = fwd.params["num_consts"], fwd.params["num_carry"]
    ncb, nkb = bwd.params["num_consts"], bwd.params["num_carry"]
    stacked = dict(zip(fwd.outputs, rf.outputs, strict=True))  # forward result -> its body value
    saved = {v for op in rf.ops if save is not None and save(program, op) for v in op.outputs}
    redone = tuple(y for y in pair.residuals if stacked[y] not in saved)  # saved residuals stay stacked
    residuals = {stacked[y] for y in redone}

    # the forward body ops that make the residuals, back to the body's inputs (or saved results)
    made = {v for op in rf.ops for v in op.outputs}
    needed, cloned = set(residuals - saved), []
    for op in reversed(rf.ops):
        if any(v in needed for v in op.outputs):
            cloned.append(op)
            needed.update(v for v in op.inputs if v in made and v not in saved)
    cloned.reverse()
    reads = _reads(cloned) | residuals  # what the clones and the backward body read of the forward body

    b = ProgramBuilder(program, block)
    new_consts: list[int] = []  # outer operands the backward scan gains, and their body inputs
    const_ins: list[int] = []
    new_xs: list[int] = []
    xs_ins: list[int] = []
    env: dict[int, int] = {}  # forward body value -> the backward body's
    outer_consts = dict(zip(bwd.inputs[:ncb], rb.inputs[:ncb], strict=True))
    outer_xs = {o: r for o, r in zip(bwd.inputs[ncb + nkb:], rb.inputs[ncb + nkb:], strict=True) if o not in redone}
    stacked_out = {v: y for y, v in stacked.items() if y not in redone}
    emitted: list[tuple[int, int]] = []  # (forward body value, its new stacked result): carries, saved values
    length = fwd.params["length"]

    def backward_input(v: int, outer: int | None, const: bool) -> None:
        """``env[v]``: the backward body's input for the forward body's ``v``, the outer value
        ``outer`` (stacked unless ``const``; None: ``v`` emitted stacked by the forward scan)."""
        if outer is not None and outer in (outer_consts if const else outer_xs):
            env[v] = (outer_consts if const else outer_xs)[outer]
            return
        env[v] = b.value(v, program.values[v].name, region=rb.id, kind="region_input")
        if outer is None:
            outer = b.value(v, f"{fwd.name}/checkpoint", shape=(length, *program.values[v].shape), phase="forward")
            emitted.append((v, outer))
        (new_consts if const else new_xs).append(outer)
        (const_ins if const else xs_ins).append(env[v])

    for k, v in enumerate(rf.inputs):
        if v in reads:
            backward_input(v, None if ncf <= k < ncf + nkf else fwd.inputs[k], k < ncf)
    for op in rf.ops:
        for v in op.outputs:
            if v in saved and v in reads:
                backward_input(v, stacked_out.get(v), False)
    for op in cloned:
        ins = tuple(env.get(v, v) for v in op.inputs)
        outs = tuple(b.value(v, program.values[v].name, region=rb.id) for v in op.outputs)
        env.update(zip(op.outputs, outs, strict=True))
        b.add(dataclasses.replace(op, inputs=ins, outputs=outs, linked_inputs=ins, linked_outputs=outs,
                                  phase="backward", name=f"{block}/recompute"))

    # the backward scan: the residuals' body inputs become the clones
    swap = {r: env.get(stacked[o], stacked[o])
            for o, r in zip(bwd.inputs[ncb + nkb:], rb.inputs[ncb + nkb:], strict=True) if o in redone}
    body_ops = list(b.ops)
    swapped = []  # the body ops reading a clone now (a user's remat call among them reads it too)
    for op in rb.ops:
        if any(v in swap for v in op.inputs):
            op = dataclasses.replace(op, inputs=tuple(swap.get(v, v) for v in op.inputs),
                                     linked_inputs=tuple(swap.get(v, v) for v in op.linked_inputs))
            swapped.append(op)
        body_ops.append(op)
    keep_xs = [(o, r) for o, r in zip(bwd.inputs[ncb + nkb:], rb.inputs[ncb + nkb:], strict=True)
               if o not in redone]
    b_ins = (list(bwd.inputs[:ncb]) + new_consts + list(bwd.inputs[ncb:ncb + nkb]) + [o for o, _ in keep_xs]
             + new_xs)
    b_body = Region(rb.id, tuple(rb.inputs[:ncb]) + tuple(const_ins) + tuple(rb.inputs[ncb:ncb + nkb])
                    + tuple(r for _, r in keep_xs) + tuple(xs_ins),
                    tuple(swap.get(v, v) for v in rb.outputs), tuple(body_ops), rb.trips, rb.role)
    b_params = dict(bwd.params, num_consts=ncb + len(new_consts), linear=(False,) * len(b_ins), jaxpr=None)
    new_bwd = scan_op(b, bwd, b_ins, list(bwd.outputs), b_body, b_params)

    # the forward scan: its residuals dropped (and the work only they needed), the checkpoints emitted
    f_outs = [y for y in fwd.outputs if y not in redone]
    f_body_outs = [stacked[y] for y in f_outs] + [v for v, _ in emitted]
    f_ops = dead_code_eliminated(list(rf.ops), set(f_body_outs))
    f_body = Region(rf.id, rf.inputs, tuple(f_body_outs), tuple(f_ops), rf.trips, rf.role)
    f_params = dict(fwd.params, jaxpr=None)
    new_fwd = scan_op(b, fwd, list(fwd.inputs), f_outs + [y for _, y in emitted], f_body, f_params)

    ops = list(program.ops)
    ops[pair.forward], ops[pair.backward] = new_fwd, new_bwd
    return dataclasses.replace(program, values=tuple(b.values), ops=tuple(ops), copies=b.copies, memo={},
                               remat_calls=calls_reading(program.remat_calls, swapped, swap))


def scan_op(b: ProgramBuilder, like: Op, ins: list[int], outs: list[int], body: Region, params: dict) -> Op:
    """``like`` (a ``scan`` op) with new operands, results, body and params, and the rule linking them."""
    rule, linked_in, linked_out = link_rule(b.values, "scan", params, ins, outs, (body,))
    return dataclasses.replace(like, inputs=tuple(ins), outputs=tuple(outs), rule=rule, params=params,
                               regions=(body,), linked_inputs=linked_in, linked_outputs=linked_out)
