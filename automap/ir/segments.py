"""Segments of the forward pass, for recomputation in a model without repeated blocks.

A model made of distinct layers (a CNN whose convolutions differ in width, an MLP head after a
stem) has no repeated block for :mod:`automap.ir.recompute` to checkpoint, yet its activations
can be recomputed in the same way, one stretch of the forward at a time. :func:`forward_segments`
cuts the forward where it first reads a weight (an input with two or more dims: a kernel; its
biases and norm scales, one dim, stay with it): segment ``i`` holds the forward ops from the first
read of the ``i``-th weight to the first read of the next, the first segment from the start, the
last to the end of the forward. Each is recomputed like a block: its residuals die with the
forward, its output (the next segment's input) stays live as a checkpoint. The cut follows the
program's structure, never the names of its modules; the segment is named after the weight it
starts with.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> def loss(w1, w2, x):
...     h = jnp.tanh(jnp.tanh(w1 @ x))
...     return jnp.sin(h @ w2).sum()
>>> a = jnp.ones((4, 4))
>>> prog = lower(jax.make_jaxpr(jax.grad(loss, (0, 1)))(a, a, a), ["w1", "w2", "x"], ["g1", "g2"])
>>> {name: len(ops) for name, ops in forward_segments(prog).items()}
{'forward from w1': 5, 'forward from w2': 2}
"""
from __future__ import annotations

from automap.ir.program import Program

PREFIX = "forward from "  # a segment's name: this, then the path of the weight it starts with


def forward_segments(program: Program) -> dict[str, tuple[int, ...]]:
    """Segment name -> the ids of its forward top-level ops, in forward order (module docstring)."""
    got = program.memo.get("forward_segments")
    if got is not None:
        return got
    forward = [op for op in program.ops if op.phase == "forward"]
    starts: dict[int, int] = {}  # position in the forward -> the weight first read there
    seen: set[int] = set()
    for j, op in enumerate(forward):
        for v in op.inputs:
            value = program.values[v]
            if value.kind == "input" and value.ndim >= 2 and v not in seen:
                seen.add(v)
                starts.setdefault(j, v)
    cuts = sorted(starts)
    out: dict[str, tuple[int, ...]] = {}
    if cuts:
        cuts[0] = 0  # the ops before the first weight (reshaping the batch) open the first segment
        for k, start in enumerate(cuts):
            end = cuts[k + 1] if k + 1 < len(cuts) else len(forward)
            name = PREFIX + program.values[starts.get(start, starts[min(starts)])].name
            out[name] = tuple(op.id for op in forward[start:end])
    program.memo["forward_segments"] = out
    return out
