"""Which spatial dims of a convolution XLA's partitioner splits: those whose windows tile the
input (:func:`tiled_spatial_dims`), for the conv rule (:mod:`automap.rules.dot`)."""
from __future__ import annotations

from typing import Any, Sequence

from automap.rules.registry import RuleContext


def tiled_spatial_dims(ctx: RuleContext, dimension_numbers: Any, window_strides: Sequence[int], padding: Any,
                       lhs_dilation: Any, rhs_dilation: Any) -> list[int]:
    """The spatial dims (0 = the first) whose windows tile the input: stride == window, no
    padding, no dilation, the input ``out * window`` long (a patch embedding; a 1x1 stride-1 conv,
    window 1). Such an input dim is the output position (parallel, shared with the output's dim),
    major, times the window offset (minor, kept whole): XLA's partitioner splits it over the
    output positions with no halo (a 4x4 patch conv, its input's 16 rows on 'model': 4 output
    rows per device, no collective). A kernel split on its window dim is gathered; windows that
    overlap (a 3x3 stride-1 conv) need a halo exchange, not modelled: those dims stay whole.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda x, w: jax.lax.conv_general_dilated(x, w, (4, 4), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> rule = lower(jax.make_jaxpr(f)(jnp.ones((2, 8, 16, 3)), jnp.ones((4, 4, 3, 16))), ["x", "w"], ["y"]).ops[0].rule
    >>> rule.operands[0][1:3], rule.results[0][1:3]  # rows 2 x 4 and columns 4 x 4: (position, offset)
    (((3, 4), (5, 6)), ((3,), (5,)))
    >>> [(rule.factors[f].size, rule.factors[f].kind) for f in (3, 4)]
    [(2, 'parallel'), (4, 'blocked')]
    """
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs, rhs = ctx.operands
    out = ctx.results[0]
    tiled = []
    for i in range(len(lhs_spec) - 2):
        window, size = rhs.shape[rhs_spec[2 + i]], out.shape[out_spec[2 + i]]
        undilated = all(not d or d[i] == 1 for d in (lhs_dilation, rhs_dilation))
        unpadded = not padding or tuple(padding[i]) == (0, 0)
        strided = bool(window_strides) and window_strides[i] == window
        if strided and unpadded and undilated and lhs.shape[lhs_spec[2 + i]] == size * window:
            tiled.append(i)
    return tiled
