"""Structural folding: values of identical layers share one decision.

Each value gets a label refined from its shape and dtype and, ``rounds`` times, from the ops that
read it (primitive, params, operand position and the labels of the op's other operands and
results), in the manner of Weisfeiler-Lehman graph hashing. Values of structurally identical
unrolled layers end up with equal labels, so a search over groups costs the same for 2 layers
as for 48 (the TAP insight). A scanned model needs no folding: its stacked parameters are
already one value per kind.
"""
from __future__ import annotations

from typing import Iterable

from automap.ir.program import Program


def _static_params(params: dict) -> tuple:
    out = []
    for k in sorted(params):
        v = params[k]
        if isinstance(v, (int, float, str, bool, tuple, type(None))):
            out.append((k, v))
        else:
            out.append((k, type(v).__name__))
    return tuple(out)


def structural_labels(program: Program, rounds: int = 3) -> dict[int, int]:
    """value id -> structural label (equal for the same value in identical layers).

    Labels are small ints: each distinct key (a value's shape, dtype and kind; an op's primitive
    and params by ``repr``, so ``1`` and ``1.0`` differ; then the labels a round combines) gets
    the next int, so equal labels mean equal keys, exactly, with no hashing."""
    ids: dict = {}
    intern = lambda key: ids.setdefault(key, len(ids))  # noqa: E731
    labels = {v.id: intern(("value", v.shape, str(v.dtype), v.kind if v.kind != "input" else "in"))
              for v in program.values}
    ops = program.all_ops
    op_static = {op.id: intern(("op", repr((op.primitive, _static_params(op.params))))) for op in ops}
    readers: dict[int, list[tuple[int, int]]] = {}
    for op in ops:
        for pos, v in enumerate(op.inputs):
            readers.setdefault(v, []).append((op.id, pos))
    for _ in range(rounds):
        op_label = {
            op.id: intern((op_static[op.id], tuple(labels[v] for v in op.inputs), tuple(labels[v] for v in op.outputs)))
            for op in ops
        }
        labels = {v.id: intern((labels[v.id], tuple(sorted((op_label[o], pos) for o, pos in readers.get(v.id, ())))))
                  for v in program.values}
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
    groups: dict[int, list[int]] = {}
    for v in values:
        groups.setdefault(labels[v], []).append(v)
    return [tuple(g) for g in groups.values()]
