"""XLA:CPU computes half-precision (bfloat16) ops in float32: the bytes its buffers and
collectives take for such values, as the cost model (:mod:`automap.cost.memory`,
:mod:`automap.cost.estimate`) prices them on a CPU topology.
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from automap.ir.program import Program

__all__ = ["F32_COMPUTED", "computed_dtype", "computed_itemsize", "stored_in_f32"]

_FLOAT32 = np.dtype("float32")

F32_COMPUTED = ("bfloat16",)
"""Dtypes XLA:CPU has no kernels for: its float normalization computes their ops in float32 (a
float16 dot's partial sums are reduce-scattered in float16: not listed)."""


def computed_itemsize(value) -> int:
    """The bytes per element XLA:CPU stores ``value`` in: float32's for a bfloat16 value an op
    makes (its float normalization computes bfloat16 ops in float32, and its simplifier drops
    the converts between them; a bf16 MLP's activations compile to
    ``f32[64,128]`` fusions, a bf16 copy of a f32 parameter is gathered as the f32 parameter);
    inputs keep their dtype (the memory estimate sizes the program's outputs at theirs apart).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(8, jnp.bfloat16)), ["x"], ["y"])
    >>> computed_itemsize(prog.values[0]), computed_itemsize(prog.values[1])  # the bf16 input, tanh's result
    (2, 4)
    """
    wide = value.kind == "intermediate" and _computed_in_f32(value.dtype)
    return 4 if wide else value.itemsize


def computed_dtype(value) -> np.dtype:
    """The element type XLA:CPU computes ``value`` in, as :func:`computed_itemsize` sizes it (a
    bfloat16 partial sum is all-reduced in float32, in the float32 reductions' combined group).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x: jnp.tanh(x) * 2)(jnp.ones(8, jnp.bfloat16)), ["x"], ["y"])
    >>> str(computed_dtype(prog.values[0])), str(computed_dtype(prog.values[1]))
    ('bfloat16', 'float32')
    """
    return _FLOAT32 if value.kind == "intermediate" and _computed_in_f32(value.dtype) else value.dtype


@functools.lru_cache(maxsize=None)
def _computed_in_f32(dtype) -> bool:
    """Whether XLA:CPU computes ``dtype`` in float32 (per dtype: numpy's ``dtype.name`` takes
    microseconds, asked ~100k times per plan)."""
    return dtype.name in F32_COMPUTED


def stored_in_f32(program: Program, size: Callable[[int], int]) -> Callable[[int], int]:
    """``size`` with each value XLA:CPU computes in float32 counted at f32's bytes
    (:func:`computed_itemsize`).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> prog = lower(jax.make_jaxpr(lambda x: jnp.tanh(x.astype(jnp.bfloat16)))(jnp.ones(8)), ["x"], ["y"])
    >>> size = stored_in_f32(prog, lambda v: prog.values[v].nbytes)
    >>> [size(v) for op in prog.ops for v in op.outputs]  # the convert's and the tanh's bf16 results
    [32, 32]
    """
    widened = _widened(program)

    def size_on_cpu(v: int) -> int:
        ratio = widened.get(v)
        return size(v) if ratio is None else size(v) * ratio[0] // ratio[1]

    return size_on_cpu


def _widened(program: Program) -> dict[int, tuple[int, int]]:
    """value id -> (:func:`computed_itemsize`, stored itemsize or 1) of each value whose bytes on
    XLA:CPU are not its own (the rest keep theirs); once per program (its memo), not per size
    asked: a plan's memory estimates ask ~400k times."""
    got = program.memo.get("cpu_float32.widened")
    if got is None or got[0] is not program.values:
        table = {}
        for v, value in enumerate(program.values):
            computed = computed_itemsize(value)
            if computed != value.itemsize or value.itemsize < 1:
                table[v] = (computed, max(value.itemsize, 1))
        got = program.memo["cpu_float32.widened"] = (program.values, table)
    return got[1]
