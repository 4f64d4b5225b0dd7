"""Activation recomputation after differentiation: a block's residuals recomputed in the backward.

The traced train step already holds ``jax.grad``'s backward pass, so the values the backward
reads from the forward (the residuals) are ordinary values of the program. To recompute a block
(the forward ops under one module path, e.g. ``GPT/blocks_1``), :func:`recompute` clones the
forward ops that make its residuals into the backward, just before the first backward op that
reads one, and points the backward readers at the clones: the residuals die with the block's
forward, and only the block's inputs (its checkpoint: the previous block's output, the
parameters) stay live. The clones read their activation inputs plus an exact zero computed from
a backward value of the same shape made just before (in a residual network, the cotangent of the
block's output), then through one ``optimization_barrier`` as ``jax.checkpoint`` lowers: the data
dependence keeps XLA from running the recomputation early or merging it into the forward (XLA:CPU
expands optimization barriers before its CSE pass, jax 0.10.2: there ``jax.checkpoint`` alone
recomputes nothing). The parameters a block recomputed wholly reads are tied to the backward too
(:func:`regathered`): a ZeRO-3 parameter is gathered again there, not held gathered from the forward.

Values the block hands to forward ops outside it (its output) and program outputs are kept, not
recomputed. A block holding control flow (a ``scan``, ``while``, ``cond``) is recomputed around it:
the control flow's results are kept, not cloned (held-out griffin's layers, each an RG-LRU
``lax.scan`` between matmuls). Blocks in a user's ``remat`` are left alone. Which blocks there are
(the units the search may recompute) is :mod:`automap.ir.recompute_units`.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> def loss(w, x):
...     with jax.named_scope("block_0"):
...         h = jnp.tanh(x @ w)
...     return (h @ w).sum()
>>> a = jnp.ones((4, 4))
>>> prog = lower(jax.make_jaxpr(jax.grad(loss))(a, a), ["w", "x"], ["g"])
>>> repeated_blocks(prog), repeated_blocks(prog, min_repeats=1)
((), ('block_0',))
>>> new = recompute(prog, ["block_0"])
>>> len(new.all_ops) - len(prog.all_ops), new.recomputed   # w, x tied (5 ops each), a barrier, the dot, tanh, 1 - tanh
(14, ('block_0',))
>>> recompute(prog, ["block_0"]) is new   # made once per program and blocks, kept in prog.memo
True
"""
from __future__ import annotations

import dataclasses
from typing import Iterable

import jax

from automap.ir.backward_ties import late_zeros, latest_backward, regather_inputs
from automap.ir.build import ProgramBuilder, call_start, calls_reading
from automap.ir.program import Op, Program, Value
from automap.ir.recompute_units import block_ops, recompute_units, repeated_blocks
from automap.ir.scan_recompute import Saved, dots_without_batch_dims, recompute_scan, scan_blocks
from automap.shardings import ShardingState

@dataclasses.dataclass(frozen=True)
class _Slice:
    residuals: tuple[int, ...]  # values the clones replace in the backward
    ops: tuple[Op, ...]  # the forward ops to clone, in program order
    inputs: tuple[int, ...]  # what the clones read from outside (through the barrier)
    at: int  # position in program.ops of the first backward reader


def _slice(program: Program, block: str, save: Saved | None = None) -> _Slice | None:
    ops = block_ops(program, block)
    made = {v for op in ops for v in op.outputs}
    block_ids = {op.id for op in ops}
    kept = set(program.outputs) & made
    # control flow is never cloned: its results are kept (before, a layer holding a scan was no block:
    # held-out griffin's FSDP recomputing every block, XLA 399,492 -> 274,420 B per device: a scratch measurement)
    kept.update(v for op in ops if op.regions or (save is not None and save(program, op)) for v in op.outputs)
    residuals: dict[int, None] = {}
    for op in program.ops:
        if op.id in block_ids:
            continue
        reads = [v for v in op.inputs if v in made]
        if not reads:
            continue
        if op.phase == "backward":
            residuals.update(dict.fromkeys(reads))
        else:  # the block's output (read by the next block) is its successor's checkpoint
            kept.update(reads)
    residuals = {v: None for v in residuals if v not in kept}
    if not residuals:
        return None
    needed = set(residuals)
    cloned: list[Op] = []
    for op in reversed(ops):
        if any(v in needed for v in op.outputs):
            cloned.append(op)
            needed.update(v for v in op.inputs if v in made and v not in kept)
    cloned.reverse()
    own = {v for op in cloned for v in op.outputs}
    inputs = dict.fromkeys(
        v for op in cloned for v in op.inputs
        if v not in own and program.values[v].kind not in ("literal", "const")
    )
    first = call_start(program.ops, min(i for i, op in enumerate(program.ops)
                                        if op.phase == "backward" and any(v in residuals for v in op.inputs)))
    return _Slice(tuple(residuals), tuple(cloned), tuple(inputs), first)


def _tie(x: jax.Array, after: jax.Array) -> jax.Array:
    """``x`` plus an exact zero computed from ``after``: the same numbers, but a value XLA must
    compute after ``after`` and cannot merge with ``x``'s other uses (XLA:CPU drops optimization
    barriers before its CSE pass, jax 0.10: ``jax.checkpoint`` saves nothing there)."""
    return x + (after != after).astype(x.dtype) * jax.numpy.zeros((), x.dtype)


def _barrier(*xs: jax.Array) -> tuple[jax.Array, ...]:
    return jax.lax.optimization_barrier(xs)


def _trigger(program: Program, at: int, like: Value) -> int | None:
    """The latest backward value made before position ``at`` with ``like``'s shape and dtype
    (in a residual network: the cotangent of the block's output), if the backward has begun."""
    return latest_backward(program, at, lambda _, value: value.shape == like.shape and value.dtype == like.dtype)


SELECTIVE = " (selective)"  # a block name's suffix: the weight matmuls' results are kept, the rest recomputed


def selective(block: str) -> str:
    """The name under which ``block`` is recomputed selectively: the results of its matmuls
    without batch dims (:func:`~automap.ir.scan_recompute.dots_without_batch_dims`) stay live,
    the rest (attention's batched dots and softmax, the norms and activations) is recomputed, as
    Megatron-LM's selective recomputation and ``jax.checkpoint_policies.dots_with_no_batch_dims_saveable``."""
    return block + SELECTIVE


REGATHER = " (re-gather)"  # a block name's suffix: recomputed wholly, its parameters gathered again too


def regathered(block: str) -> str:
    """The name under which ``block`` is recomputed wholly and the parameters its recomputation
    reads are tied to the backward (:func:`~automap.ir.backward_ties.regather_inputs`): the clones
    and every later backward reader read the tied copy, so a ZeRO-3 parameter is gathered again in
    the backward instead of being held, gathered, from the forward (FSDP's re-gather). Whole
    recomputation (the block's own name) does the same: the name is kept for plans that name it.

    >>> regathered("GPT/blocks_1"), block_mode(regathered("GPT/blocks_1"))
    ('GPT/blocks_1 (re-gather)', ('GPT/blocks_1', None))
    """
    return block + REGATHER


def block_mode(name: str) -> tuple[str, Saved | None]:
    """(the block, what its recomputation keeps) of a name :func:`recompute` takes."""
    if name.endswith(SELECTIVE):
        return name[: -len(SELECTIVE)], dots_without_batch_dims
    if name.endswith(REGATHER):
        return name[: -len(REGATHER)], None
    return name, None


def pending_blocks(program: Program) -> tuple[str, ...]:
    """The blocks (:func:`recompute_units`) ``program`` does not recompute yet, in either mode."""
    done = {block_mode(d)[0] for d in program.recomputed}
    return tuple(b for b in recompute_units(program) if b not in done)


def recompute(program: Program, blocks: Iterable[str]) -> Program:
    """``program`` with each block's residuals recomputed in the backward (module docstring;
    a name from :func:`selective`: only what the block's weight matmuls do not make; recomputed
    wholly, by its own name or :func:`regathered`'s, its parameters are gathered again); blocks
    with nothing to recompute, or recomputed already, are skipped. The result records them in
    ``recomputed``; the backward's constant zeros are made where it reads them
    (:func:`~automap.ir.backward_ties.late_zeros`).
    The result depends on ``program`` and the names alone: it is made once per program and names
    (kept in ``program.memo``: the states of one search, each plan the recompute search tries,
    share it and what is memoised on it, e.g. its liveness)."""
    names = tuple(blocks)
    key = ("recompute", names, late_zeros)  # (the zeros' placement, a module function a caller may swap)
    got = program.memo.get(key)
    if got is None:
        got = program.memo[key] = _recompute(program, names)
    return got


def _recompute(program: Program, blocks: tuple[str, ...]) -> Program:
    done = list(program.recomputed)
    for name in blocks:
        block, save = block_mode(name)
        if block in {block_mode(d)[0] for d in done}:  # once per block, in one mode
            continue
        if block in scan_blocks(program):
            program = late_zeros(recompute_scan(program, block, save))
            done.append(name)
            continue
        s = _slice(program, block, save)
        if s is None:
            continue
        # the zeros tied after each block: the same program whether blocks come one call at a time or all in one
        # recomputed wholly, its parameters are gathered again: held gathered from the forward, they
        # outweighed what recomputation saves (XLA: hf_gpt2 226,844 -> 204,380 B, eqx_rope 147,832 -> 129,160 B)
        program = late_zeros(_with_clones(program, s, block, save is None))
        done.append(name)
    if tuple(done) == program.recomputed:
        return program
    return dataclasses.replace(program, recomputed=tuple(done), memo={})


def _with_clones(program: Program, s: _Slice, block: str, regather: bool = False) -> Program:
    b = ProgramBuilder(program, block)
    params = regather_inputs(b, program, s.inputs, s.at) if regather else {}  # parameter -> its tied copy
    fed: dict[int, int] = dict(params)  # clone input -> what the clones read instead
    for v in s.inputs:
        if v in params:
            continue
        t = _trigger(program, s.at, program.values[v]) if program.values[v].kind != "input" else None
        fed[v] = v if t is None else b.trace(_tie, [v, t], [t, v])[0]
    outs = b.trace(_barrier, [fed[v] for v in s.inputs], list(s.inputs))
    renamed = dict(zip(s.inputs, outs, strict=True))
    for op in s.ops:
        ins = tuple(renamed.get(v, v) for v in op.inputs)
        made = tuple(b.value(v, b.values[v].name) for v in op.outputs)
        renamed.update(zip(op.outputs, made, strict=True))
        b.add(dataclasses.replace(op, inputs=ins, outputs=made, linked_inputs=ins, linked_outputs=made,
                                  phase="backward"))
    residual = {v: renamed[v] for v in s.residuals}
    residual.update(params)  # the backward's own readers of a re-gathered parameter read it too
    rest, read = [], []
    for op in program.ops[s.at:]:
        if op.phase == "backward" and any(v in residual for v in op.inputs):
            ins = tuple(residual.get(v, v) for v in op.inputs)
            linked = tuple(residual.get(v, v) for v in op.linked_inputs)
            op = dataclasses.replace(op, inputs=ins, linked_inputs=linked)
            read.append(op)
        rest.append(op)
    ops = program.ops[: s.at] + tuple(b.ops) + tuple(rest)
    return dataclasses.replace(program, values=tuple(b.values), ops=ops, copies=b.copies, memo={},
                               remat_calls=calls_reading(program.remat_calls, read, residual))


def copied_specs(program: Program, specs: dict) -> dict:
    """``specs`` (value id -> spec) extended to the values :func:`recompute` added: a clone or a
    barrier result has the spec of the value it copies."""
    out = dict(specs)
    for v, o in program.copies.items():
        if o in specs:  # a stacked copy (a scan's checkpoints) has a leading layers dim, never sharded
            out[v] = ((),) * (program.values[v].ndim - program.values[o].ndim) + specs[o]
    return out


def recompute_state(state: ShardingState, blocks: Iterable[str]) -> ShardingState:
    """``state`` on :func:`recompute`'s program: each copy has its original's spec and priority."""
    program = recompute(state.program, blocks)
    if program.recomputed == state.program.recomputed:
        return state
    return on_program(state, program)


def on_program(state: ShardingState, program: Program) -> ShardingState:
    """``state`` on ``program``, a rewrite of its program that adds values copying others
    (``program.copies``): each copy has its original's spec and priority."""
    specs = copied_specs(program, dict(state.specs))
    priority = dict(state.priority)
    for v, o in program.copies.items():
        lead = program.values[v].ndim - program.values[o].ndim
        for d in range(program.values[o].ndim):
            if (o, d) in state.priority:
                priority[(v, d + lead)] = state.priority[(o, d)]
    return ShardingState(program, state.axes, specs, priority, state.frozen, state.next_priority, state.labels)
