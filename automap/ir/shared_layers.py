"""Layers that share their parameters: one layer applied again and again (ALBERT's shared
encoder layer, a weight-tied recurrence unrolled in a Python loop).

Such a model has no numbered modules (every application runs under the same module path) and no
group of alike parameters one per layer: :func:`~automap.ir.recompute_units.structural_blocks` finds
nothing, yet each application is a block of the forward whose residuals can be recomputed. Its
parameters give it away: each is read once per application, the reads one period apart (the
ops of identical applications repeat). :func:`shared_layers` groups the inputs the forward reads
two or more times at one period by their number of reads and that period; the largest group
whose reads fall application by application (every read of application ``i`` before any of
application ``i + 1``) and whose applications run the same primitives gives the applications,
each the forward ops from its first read of a shared parameter on, one period long. A parameter
read at other distances (a tied embedding, read by the lookup and again by the output
projection) falls in a group of its own.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> def loss(w, x):
...     for _ in range(3):  # one layer, applied three times
...         x = jnp.tanh(x @ w)
...     return x.sum()
>>> a = jnp.ones((4, 4))
>>> prog = lower(jax.make_jaxpr(jax.grad(loss))(a, a), ["w", "x"], ["g"])
>>> {name: len(ops) for name, ops in shared_layers(prog).items()}
{'shared layer (call 1 of 3)': 3, 'shared layer (call 2 of 3)': 3, 'shared layer (call 3 of 3)': 3}
"""
from __future__ import annotations

from automap.ir.program import Program


def shared_layers(program: Program, min_repeats: int = 2) -> dict[str, tuple[int, ...]]:
    """Application name -> the ids of its forward top-level ops, in forward order (module
    docstring); empty where no input is read at least ``max(min_repeats, 2)`` times. Named by the
    module path of its ops (``Model/layer (call 2 of 4)``; ``shared layer`` where they have none)
    and the application's number."""
    key = ("shared_layers", min_repeats)
    if key in program.memo:
        return program.memo[key]
    forward = [op for op in program.ops if op.phase == "forward"]
    reads: dict[int, list[int]] = {}  # input -> the positions in the forward of the ops reading it
    for j, op in enumerate(forward):
        for v in dict.fromkeys(op.inputs):
            if program.values[v].kind == "input":
                reads.setdefault(v, []).append(j)
    alike: dict[tuple[int, ...], list[int]] = {}  # the distances between an input's reads -> the inputs
    for v, at in reads.items():
        gaps = {b - a for a, b in zip(at, at[1:])}
        if len(at) >= max(min_repeats, 2) and len(gaps) == 1:  # read at one period: once per application
            alike.setdefault((len(at), *gaps), []).append(v)
    groups = sorted(alike.values(), key=lambda g: (-len(g), -len(reads[g[0]]), g[0]))
    out: dict[str, tuple[int, ...]] = {}
    for group in groups:
        n = len(reads[group[0]])
        starts = [min(reads[v][i] for v in group) for i in range(n)]
        period = starts[1] - starts[0]
        first = [op.primitive for op in forward[starts[0]:starts[0] + period]]
        if any(max(reads[v][i] for v in group) >= starts[i + 1] for i in range(n - 1)) or any(
                [op.primitive for op in forward[s:s + period]] != first for s in starts[1:]):
            continue  # not applications of one layer: its reads not one application after another, its ops unlike
        ends = [s + period for s in starts]
        scopes = [op.name.split("/") for op in forward[starts[0]:ends[0]] if op.name]
        common = "/".join(p[0] for p in _prefix(scopes)) or "shared layer"
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            out[f"{common} (call {i + 1} of {n})"] = tuple(op.id for op in forward[start:end])
        break
    program.memo[key] = out
    return out


def _prefix(paths: list[list[str]]) -> list[tuple[str, ...]]:
    """The parts every path starts with."""
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts)
    return common

