"""Lookups that hold no buffer of their own in XLA's program: a ``gather`` whose readers XLA
fuses it into (:func:`fused_lookups`) and one in a broadcast scalar, which XLA's algebraic
simplifier turns into the broadcast (:func:`scalar_broadcasts`). :func:`automap.cost.memory.materialized`
leaves both out of the values stored as buffers."""
from __future__ import annotations

import collections
from typing import Iterable, Sequence

from automap.ir.program import Op
from automap.rules import traits_of

__all__ = ["fused_lookups", "scalar_broadcasts"]


def fused_lookups(ops: Sequence[Op], outputs: Iterable[int] = ()) -> frozenset[int]:
    """Results of ``gather`` that only fusing ops read (elementwise ops, and concatenations,
    pads and reductions, which read fused operands) and that are no output: XLA fuses the
    lookup into each reader's loop, no buffer of its own (an embedding plus positions: estimate
    1.43x XLA's memory with the rows stored; a nearest-neighbour upsampling concatenated with a
    skip, the held-out UNet). Read by a dot, or by a collective (a lookup in a table split
    over its features, all-reduced: :func:`materialized`'s ``collected``), a gather is stored.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> args = jnp.ones((16, 4)), jnp.zeros(8, jnp.int32), jnp.ones((8, 4))
    >>> added, multiplied = (lambda t, i, p: t[i] + p), (lambda t, i, p: t[i] @ p.T)
    >>> [len(fused_lookups((prog := lower(jax.make_jaxpr(f)(*args), ["t", "i", "p"], ["y"])).ops, prog.outputs))
    ...  for f in (added, multiplied)]
    [1, 0]
    """
    readers: dict[int, list[Op]] = collections.defaultdict(list)
    for op in ops:
        for v in set(op.inputs):
            readers[v].append(op)
    out = set(outputs)
    fused: set[int] = set()
    for op in reversed(ops):  # a lookup in a fused lookup fuses with it (an upsampling's two gathers)
        if op.primitive == "gather" and op.outputs[0] not in out and all(
                not r.regions and (not traits_of(r.primitive).reads_memory or r.outputs[0] in fused)
                for r in readers[op.outputs[0]]):
            fused.add(op.outputs[0])
    return frozenset(fused)


def scalar_broadcasts(ops: Sequence[Op]) -> frozenset[int]:
    """Values of ``ops`` that are a scalar broadcast: made by ``broadcast_in_dim`` of a scalar,
    or looked up (``gather``) in one, which XLA's algebraic simplifier turns into the broadcast
    itself (``segment_max``'s initial table in its gradient: a 32 KiB lookup XLA never makes).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda i: jnp.full((64, 32), -jnp.inf)[i])(jnp.zeros(8, jnp.int32)), ["i"], ["y"])
    >>> [op.primitive for op in prog.ops if set(op.outputs) & scalar_broadcasts(prog.ops)]
    ['broadcast_in_dim', 'gather']
    """
    out: set[int] = set()
    for op in ops:
        if (op.primitive == "broadcast_in_dim" and op.inputs and not op.rule.operands[0]) or (
                op.primitive == "gather" and op.inputs[0] in out):
            out.update(op.outputs)
    return frozenset(out)
