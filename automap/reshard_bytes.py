"""How many bytes a way of running an op moves: what XLA's partitioner weighs where it chooses
between two ways (:mod:`automap.analysis` for elementwise work and reductions,
:mod:`automap.output_free_splits` for a dot's free split kept over its sum)."""
from __future__ import annotations


def moved_bytes(templates: tuple) -> int:
    """Bytes per device the reshard templates ``(position, kind, axes, bytes, where, ...)`` move,
    an all-reduce twice (a reduce-scatter and an all-gather).

    >>> moved_bytes(((0, "all-gather", ("model",), 1024, "operand"), (2, "all-reduce", ("data",), 512, "result")))
    2048
    """
    return sum(nbytes * (2 if kind == "all-reduce" else 1) for _, kind, _, nbytes, *_ in templates)
