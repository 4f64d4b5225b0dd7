"""Structural folding: values of identical layers share one decision.

Each value gets a label refined from its shape and dtype and, ``rounds`` times, from the ops that
read it (primitive, params, operand position and the labels of the op's other operands and
results), in the manner of Weisfeiler-Lehman graph hashing. Values of structurally identical
unrolled layers end up with equal labels, so a search over groups costs the same for 2 layers
as for 48 (the TAP insight). A scanned model needs no folding: its stacked parameters are
already one value per kind.
"""
from __future__ import annotations

import hashlib
from typing import Iterable

from automap.ir.program import Program


def _h(*parts: object) -> str:
    return hashlib.blake2b(repr(parts).encode(), digest_size=8).hexdigest()


def _static_params(params: dict) -> tuple:
    out = []
    for k in sorted(params):
        v = params[k]
        if isinstance(v, (int, float, str, bool, tuple, type(None))):
            out.append((k, v))
        else:
            out.append((k, type(v).__name__))
    return tuple(out)


def structural_labels(program: Program, rounds: int = 3) -> dict[int, str]:
    """value id -> structural label (equal for the same value in identical layers)."""
    labels = {v.id: _h(v.shape, str(v.dtype), v.kind if v.kind != "input" else "in") for v in program.values}
    ops = program.all_ops
    op_static = {op.id: _h(op.primitive, _static_params(op.params)) for op in ops}
    readers: dict[int, list[tuple[int, int]]] = {}
    for op in ops:
        for pos, v in enumerate(op.inputs):
            readers.setdefault(v, []).append((op.id, pos))
    for _ in range(rounds):
        op_label = {
            op.id: _h(op_static[op.id], tuple(labels[v] for v in op.inputs), tuple(labels[v] for v in op.outputs))
            for op in ops
        }
        new = {}
        for v in program.values:
            context = sorted((op_label[o], pos) for o, pos in readers.get(v.id, ()))
            new[v.id] = _h(labels[v.id], context)
        labels = new
    return labels


def fold(program: Program, values: Iterable[int], rounds: int = 3) -> list[tuple[int, ...]]:
    """Group ``values`` by structural label, in order of first appearance.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def f(w0, w1, x):
    ...     return jnp.tanh(jnp.tanh(x @ w0) @ w1).sum()
    >>> a = jnp.ones((4, 4))
    >>> prog = lower(jax.make_jaxpr(f)(a, a, a), ["w0", "w1", "x"], ["y"])
    >>> len(fold(prog, prog.inputs))   # w0 and w1 read different things (x vs tanh): 3 groups
    3
    """
    labels = structural_labels(program, rounds)
    groups: dict[str, list[int]] = {}
    for v in values:
        groups.setdefault(labels[v], []).append(v)
    return [tuple(g) for g in groups.values()]
