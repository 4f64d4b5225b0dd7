"""XLA:CPU computes half-precision (bfloat16) ops in float32: the bytes its buffers and
collectives take for such values, as the cost model (:mod:`automap.cost.memory`,
:mod:`automap.cost.estimate`) prices them on a CPU topology.
"""
from __future__ import annotations

from typing import Callable

from automap.ir.program import Program

__all__ = ["F32_COMPUTED", "computed_itemsize", "stored_in_f32"]

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
    wide = value.kind == "intermediate" and value.dtype.name in F32_COMPUTED
    return 4 if wide else value.itemsize


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
    values = program.values

    def size_on_cpu(v: int) -> int:
        return size(v) * computed_itemsize(values[v]) // max(values[v].itemsize, 1)

    return size_on_cpu
