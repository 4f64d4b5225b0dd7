"""The order in which XLA hands a program's ops to Shardy (the HLO module's post-order), which
:func:`automap.xla_layout.xla_layout` follows."""
from __future__ import annotations

from automap.ir.program import Op, Program

__all__ = ["hlo_order"]


def hlo_order(program: Program) -> list[Op]:
    """``program``'s ops in the order Shardy meets them: XLA hands it the HLO module's post-order,
    a depth-first walk from the output tuple (each output in turn, an op's operands first to last,
    an op after its operands), not the jaxpr's order; ops no output needs come first (from each in
    program order), an op's nested ops right after it. A gradient's outputs are the parameters'
    order: the backward ops of a parameter's gradient come before those of the ones after it.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def f(x, y):
    ...     c = jnp.cos(y)
    ...     return jnp.sin(x), c
    >>> prog = lower(jax.make_jaxpr(f)(1.0, 2.0), ["x", "y"], ["s", "c"])
    >>> [op.primitive for op in prog.ops], [op.primitive for op in hlo_order(prog)]
    (['cos', 'sin'], ['sin', 'cos'])
    """
    producer = {v: op for op in program.ops for v in op.outputs}
    needed = {v for op in program.ops for v in op.inputs} | set(program.outputs)
    roots = [op for op in program.ops if not any(v in needed for v in op.outputs)]
    roots += [producer[v] for v in program.outputs if v in producer]
    done: set[int] = set()
    order: list[Op] = []
    for root in roots:
        stack = [(root, False)]
        while stack:
            op, expanded = stack.pop()
            if op.id in done:
                continue
            if expanded:
                done.add(op.id)
                order.append(op)
                continue
            stack.append((op, True))
            stack.extend((producer[v], False) for v in reversed(op.inputs) if v in producer and producer[v].id not in done)
    nested = {op.id: [o for o, _ in _walk(op)] for op in order if op.regions}
    return [o for op in order for o in [op, *nested.get(op.id, ())]]


def _walk(op: Op):
    for region in op.regions:
        for inner in region.ops:
            yield inner, 1
            yield from _walk(inner)
