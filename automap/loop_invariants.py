"""The values of loop bodies that are the same on every trip, which XLA reshards once before the
loop (:func:`automap.analysis.reshards` counts their collectives once per loop, not per trip)."""
from __future__ import annotations

from automap.ir.program import Program

__all__ = ["loop_invariants"]


def loop_invariants(program: Program) -> tuple[frozenset[int], dict[int, int]]:
    """(the values of loop bodies that are the same on every trip: a ``scan``'s or ``while``'s
    constant operands inside the body and what the body computes from them alone, region id ->
    trips). XLA reshards these once, before the loop (a flax ``nn.RNN``'s kernels, split by FSDP:
    gathered once per step, not once per time step). Memoised on the program.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> def f(w, xs):
    ...     return jax.lax.scan(lambda h, x: (jnp.tanh(h @ w.T + x), None), xs[0], xs)[0]
    >>> prog = lower(jax.make_jaxpr(f)(jnp.ones((4, 4)), jnp.ones((3, 4))), ["w", "xs"], ["y"])
    >>> invariant, trips = loop_invariants(prog)
    >>> sorted(prog.values[v].shape for v in invariant), list(trips.values())  # w and w.T in the body
    ([(4, 4), (4, 4)], [3])
    """
    got = program.memo.get("loop_invariants")
    if got is not None:
        return got
    invariant: set[int] = set()
    trips: dict[int, int] = {}
    for op in program.all_ops:
        for region in op.regions:
            trips[region.id] = region.trips
        if op.primitive not in ("scan", "while"):
            continue
        body = op.regions[-1]
        known = set(op.loop_constants())
        for inner in body.ops:
            if not inner.regions and inner.inputs and all(
                    v in known or program.values[v].kind in ("literal", "const") for v in inner.inputs):
                known.update(inner.outputs)
        invariant |= known
    program.memo["loop_invariants"] = got = (frozenset(invariant), trips)
    return got
