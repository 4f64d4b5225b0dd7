"""Which spatial dims of a convolution XLA's partitioner splits: those whose windows tile the
input (:func:`tiled_spatial_dims`) and those whose overlapping windows it runs split with a halo
exchange (:func:`windowed_spatial_dims`, :func:`summed_window_dims`), for the conv rule
(:mod:`automap.rules.dot`)."""
from __future__ import annotations

import math
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
    overlap (a 3x3 stride-1 conv) need a halo exchange (:func:`windowed_spatial_dims`).

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


def windowed_spatial_dims(ctx: RuleContext, dimension_numbers: Any, window_strides: Sequence[int], padding: Any,
                          lhs_dilation: Any, rhs_dilation: Any) -> list[int]:
    """The spatial dims (0 = the first) whose overlapping windows XLA runs split with a halo
    exchange (:mod:`automap.conv_halos`): not tiled, undilated, at least as many windows as the
    window is long (Shardy's rule then shares the input dim's major factor with the output's:
    ``sdy`` propagates a split through the conv), the input ``out * k`` long (stride-``k`` SAME:
    a 3-wide stride-1 SAME conv over 16 rows, 16 windows). Such an input dim is the output
    position (major) times ``k`` (minor, kept whole).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    >>> rule = lower(jax.make_jaxpr(f)(jnp.ones((2, 16, 8)), jnp.ones((3, 8, 8))), ["x", "w"], ["y"]).ops[0].rule
    >>> rule.operands[0][1], rule.results[0][1], rule.factors[rule.results[0][1][0]]  # rows shared, halos priced
    ((3,), (3,), Factor(size=16, kind='parallel'))
    """
    tiled = tiled_spatial_dims(ctx, dimension_numbers, window_strides, padding, lhs_dilation, rhs_dilation)
    return [i for i, window, windows, length in _undilated_dims(ctx, dimension_numbers, padding, lhs_dilation,
                                                                 rhs_dilation)
            if i not in tiled and 1 < window <= windows and length % windows == 0]


def summed_window_dims(ctx: RuleContext, dimension_numbers: Any, window_strides: Sequence[int], padding: Any,
                       lhs_dilation: Any, rhs_dilation: Any) -> list[int]:
    """The spatial dims (0 = the first) whose window is longer than the output (a kernel
    gradient's: the window is the output's cotangent, the output the kernel's few taps) that XLA
    runs split along the window, a partial sum with a halo exchange of the input
    (:mod:`automap.conv_halos`): undilated, stride 1, explicit padding, the input ``window * k``
    long. Shardy's rule shares the input dim's major factor with the kernel's there.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.rules.registry import Factor
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"))
    >>> grad = jax.grad(lambda w, x: conv(x, w).sum())  # its kernel gradient: x (2, 16, 8) against dy (2, 16, 8)
    >>> prog = lower(jax.make_jaxpr(grad)(jnp.ones((3, 8, 8)), jnp.ones((2, 16, 8))), ["w", "x"], ["dw"])
    >>> rule = [op for op in prog.ops if op.primitive == "conv_general_dilated"][-1].rule
    >>> [rule.factors[f] for f in rule.operands[0][1]] == [Factor(16, "reduction")] == [rule.factors[f] for f in rule.operands[1][1]]
    True
    """
    return [i for i, window, windows, length in _undilated_dims(ctx, dimension_numbers, padding, lhs_dilation,
                                                                 rhs_dilation)
            if (not window_strides or window_strides[i] == 1) and windows < window and length % window == 0]


def _undilated_dims(ctx: RuleContext, dimension_numbers: Any, padding: Any, lhs_dilation: Any,
                    rhs_dilation: Any) -> list[tuple[int, int, int, int]]:
    """``(i, window, windows, input length)`` of each spatial dim ``i`` without dilation, the
    padding given as pairs (as jaxprs hold it)."""
    if isinstance(padding, str):
        return []
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    (lhs, rhs), out = ctx.operands, ctx.results[0]
    return [(i, rhs.shape[rhs_spec[2 + i]], out.shape[out_spec[2 + i]], lhs.shape[lhs_spec[2 + i]])
            for i in range(len(lhs_spec) - 2) if all(not d or d[i] == 1 for d in (lhs_dilation, rhs_dilation))]


def swapped_window_ratio(ctx: RuleContext, dimension_numbers: Any, window_strides: Sequence[int], padding: Any,
                         lhs_dilation: Any, rhs_dilation: Any) -> tuple[int, int]:
    """``(input window, kernel window)``: the spatial sizes XLA's conv operand swap compares, whose
    ratio scales a convolution's FLOPs when it swaps (``(1, 1)`` when it does not). XLA (its
    ``ConvOperandSwapper``, on by default) makes the input the window when the kernel's window,
    over the spatial dims that are neither a whole contraction (window == input, no padding,
    stride or dilation) nor a group dim (base dilation == window, stride == window - 1, no
    padding), holds more elements than the input's: a 3x3 kernel over a 2x2 or 1x1 map (a ResNet's
    last stages), a transposed conv's kernel gradient (the window: the output's gradient, larger
    than the undilated input). The swapped conv reads the input's elements alone, so its FLOPs
    are ``input / kernel`` of the count over the kernel window: the taps that read only padding
    or the dilation's holes are gone. A size-1 input dim under full padding (``window - 1`` on
    each side, stride 1, no window dilation) counts as the kernel's size in that comparison.
    Grouped convs are not swapped (the caller leaves them out).

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> conv = lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    >>> op = lower(jax.make_jaxpr(conv)(jnp.ones((8, 2, 2, 4)), jnp.ones((3, 3, 4, 6))), ["x", "w"], ["y"]).ops[0]
    >>> swapped_window_ratio(RuleContext(op.primitive, (jnp.ones((8, 2, 2, 4)), jnp.ones((3, 3, 4, 6))),
    ...                                  (jnp.ones((8, 2, 2, 6)),)), **{k: op.params[k] for k in (
    ...     "dimension_numbers", "window_strides", "padding", "lhs_dilation", "rhs_dilation")})
    (4, 9)
    """
    lhs_spec, rhs_spec, _ = dimension_numbers
    lhs, rhs = ctx.operands
    kernel_window = input_window = 1
    for i in range(len(lhs_spec) - 2):
        window, size = rhs.shape[rhs_spec[2 + i]], lhs.shape[lhs_spec[2 + i]]
        stride = window_strides[i] if window_strides else 1
        base = lhs_dilation[i] if lhs_dilation else 1
        dilation = rhs_dilation[i] if rhs_dilation else 1
        low, high = tuple(padding[i]) if padding and not isinstance(padding, str) else (0, 0)
        plain = (low, high) == (0, 0) and dilation == 1
        if plain and ((base == window and stride == window - 1) or (size == window and base == 1 and stride == 1)):
            continue  # a group dim or a whole contraction: kept as it is
        kernel_window *= window
        full = size == 1 and stride == 1 and dilation == 1 and low == high == window - 1
        input_window *= window if full else size
    if kernel_window <= input_window:
        return 1, 1
    swapped = math.prod(lhs.shape[d] for d in lhs_spec[2:])
    return swapped, math.prod(rhs.shape[d] for d in rhs_spec[2:])
