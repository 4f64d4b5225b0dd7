"""How large Shardy takes a value to be at an op: the product of the sizes of the op's factors the
value holds (Shardy's aggressive strategy hands a contested mesh axis to the factor whose source
value is largest by this measure, :func:`automap.xla_layout.xla_layout`).

For most ops every dim of a value is one factor or several whose sizes multiply to it, and the
measure is the value's element count. A convolution differs (Shardy's rule for
``stablehlo.convolution``, jax 0.10.2): an input spatial dim is a factor of the output's size
(its windows) and one of the window's size, each taken at most what the input dim leaves, the
larger first; a factor of one element is dropped. The kernel's window dim has a factor only
where the windows leave room for it: a same-padded 3-wide window over 16 positions has 16
windows, which take the whole input dim, so the kernel's window dim has no factor and the kernel
counts its features alone. Measured: a (8, 16, 32) input split on the batch against a
(3, 32, O) kernel split on its output features over the same axes keeps the batch for
O <= 128 (the kernel's 32 x O against the input's 8 x 16 x 32) and gives the result the
features for O >= 136.
"""
from __future__ import annotations

import math
from typing import Sequence

from automap.ir.program import Op

__all__ = ["tensor_size"]


def tensor_size(op: Op, position: int, values: Sequence) -> int:
    """Shardy's size of the value at ``position`` of ``op``'s linked operands then results.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> conv = lambda x, k: jax.lax.conv_general_dilated(x, k, (1,), [(1, 1)], dimension_numbers=("NWC", "WIO", "NWC"))
    >>> prog = lower(jax.make_jaxpr(conv)(jnp.ones((8, 16, 32)), jnp.ones((3, 32, 64))), ["x", "k"], ["y"])
    >>> [tensor_size(prog.ops[0], t, prog.values) for t in range(3)]  # input, kernel (no window factor), result
    [4096, 2048, 8192]
    """
    vid = op.linked[position]
    if op.primitive == "conv_general_dilated" and op.params.get("dimension_numbers") is not None:
        shapes = [values[v].shape for v in op.linked]
        if len(shapes) == 3:
            return _conv_sizes(op.params["dimension_numbers"], *shapes)[position]
    return math.prod(values[vid].shape)


def _conv_sizes(dimension_numbers, lhs: tuple, rhs: tuple, out: tuple) -> tuple[int, int, int]:
    """(input, kernel, result) sizes by Shardy's convolution factors: batch (input, result), the
    spatial factors (module docstring), the input features (input, kernel), the output features
    (kernel, result); batch and feature groups split those and multiply back to the same sizes."""
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    windows = window_cells = 1
    for ld, rd, od in zip(lhs_spec[2:], rhs_spec[2:], out_spec[2:], strict=True):
        remaining, n_windows, window = lhs[ld], out[od], rhs[rd]
        taken = {}
        order = [("windows", n_windows), ("window", window)]
        for kind, size in order if n_windows >= window else order[::-1]:
            size = min(remaining, size)
            if size > 1:
                taken[kind] = size
                remaining //= size
        windows *= taken.get("windows", 1)
        window_cells *= taken.get("window", 1)
    lhs_size = lhs[lhs_spec[0]] * lhs[lhs_spec[1]] * windows * window_cells
    rhs_size = rhs[rhs_spec[0]] * rhs[rhs_spec[1]] * window_cells
    out_size = out[out_spec[0]] * out[out_spec[1]] * windows
    return lhs_size, rhs_size, out_size
