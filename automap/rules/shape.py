"""Shape ops: broadcast, reshape (merging and splitting factors), transpose, squeeze, concatenate,
pad, slice, rev, split, iota."""
from __future__ import annotations

import math
from typing import Any, Sequence

from automap.rules.registry import (
    Factor, FactorRule, RuleContext, einsum, letters, register, replicated,
)
from automap.rules.traits import ASSEMBLY, DATA_MOVEMENT, ELEMENTWISE, PAD, RELABEL, SLICE


@register("broadcast_in_dim", traits=RELABEL)
def _broadcast_in_dim(
    ctx: RuleContext, *, shape: Sequence[int], broadcast_dimensions: Sequence[int], **_: Any
) -> FactorRule:
    out = letters(len(shape))
    (x, *dyn) = ctx.operands
    if dyn:
        return replicated(ctx)
    term = "".join(
        out[d] if x.shape[i] == shape[d] else "." for i, d in enumerate(broadcast_dimensions)
    )
    return einsum(ctx, f"{term}->{out}")


@register("transpose", traits=DATA_MOVEMENT)
def _transpose(ctx: RuleContext, *, permutation: Sequence[int], **_: Any) -> FactorRule:
    term = letters(len(permutation))
    return einsum(ctx, f"{term}->{''.join(term[p] for p in permutation)}")


@register("squeeze", traits=RELABEL)
def _squeeze(ctx: RuleContext, *, dimensions: Sequence[int], **_: Any) -> FactorRule:
    n = ctx.operands[0].ndim
    dims = {d % n for d in dimensions}
    term = "".join("." if i in dims else c for i, c in enumerate(letters(n)))
    return einsum(ctx, f"{term}->{term.replace('.', '')}")


@register("expand_dims", traits=RELABEL)
def _expand_dims(ctx: RuleContext, *, dimensions: Sequence[int], **_: Any) -> FactorRule:
    n = ctx.results[0].ndim
    dims = {d % n for d in dimensions}
    term = "".join("." if i in dims else c for i, c in enumerate(letters(n)))
    return einsum(ctx, f"{term.replace('.', '')}->{term}")


def _groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Split two shapes of equal size into runs of dims with equal products (size-1 dims alone)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1:
            groups.append(([i], []))
            i += 1
            continue
        if j < len(b) and b[j] == 1:
            groups.append(([], [j]))
            j += 1
            continue
        ga, gb = [i], [j]
        pa, pb = a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ga.append(i)
                pa *= a[i]
                i += 1
            else:
                gb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ga, gb))
    return groups


@register("reshape", traits=RELABEL)
def _reshape(ctx: RuleContext, *, new_sizes: Sequence[int], dimensions: Any = None, **_: Any) -> FactorRule:
    """Both shapes are read as mixed-radix digits of one flat index. Within each run of dims with
    equal products, the walk peels common major factors off the current dims of both sides
    (their gcd): a merge puts the merged dims' factors in the merged dim (major first), a split
    the reverse, and (8, 12) -> (12, 8) shares a major factor 4. Once the digits no longer
    line up (gcd 1), the rest of the run stays whole (one blocked factor). With ``dimensions``
    (``lax.reshape(x, sizes, dimensions)``: ``x`` transposed by ``dimensions`` first, as JAX's
    depthwise-conv gradient reshapes its kernel) the walk reads the transposed dims.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> f = lambda k: jax.lax.reshape(k, (3, 3, 8, 1), dimensions=(0, 1, 3, 2, 4))
    >>> rule = lower(jax.make_jaxpr(f)(jnp.ones((3, 3, 1, 8, 1))), ["k"], ["y"]).ops[0].rule
    >>> rule.operands[0], rule.results[0]  # the 8 channels move from dim 3 to dim 2
    (((0,), (1,), (), (2,), ()), ((0,), (1,), (2,), ()))
    """
    (x,) = ctx.operands[:1]
    if len(ctx.operands) != 1:
        return replicated(ctx)
    order = tuple(dimensions) if dimensions is not None else tuple(range(len(x.shape)))
    shape = tuple(x.shape[d] for d in order)
    factors: list[Factor] = []
    ins: list[list[int]] = [[] for _ in shape]
    outs: list[list[int]] = [[] for _ in new_sizes]
    for ga, gb in _groups(shape, tuple(new_sizes)):
        if not ga or not gb:
            continue  # a size-1 dim: nothing to shard
        i = j = 0
        ra, rb = shape[ga[0]], new_sizes[gb[0]]
        while True:
            if ra == 1 and i + 1 < len(ga):
                i, ra = i + 1, shape[ga[i + 1]]
                continue
            if rb == 1 and j + 1 < len(gb):
                j, rb = j + 1, new_sizes[gb[j + 1]]
                continue
            if ra == 1 and rb == 1:
                break  # both sides consumed
            g = math.gcd(ra, rb)
            if g == 1:  # the digits no longer line up: the remainder stays whole
                rest = ra * math.prod(shape[d] for d in ga[i + 1 :])
                factors.append(Factor(rest, "blocked"))
                for d in ga[i:]:
                    ins[d].append(len(factors) - 1)
                for d in gb[j:]:
                    outs[d].append(len(factors) - 1)
                break
            factors.append(Factor(g))
            ins[ga[i]].append(len(factors) - 1)
            outs[gb[j]].append(len(factors) - 1)
            ra, rb = ra // g, rb // g
    operand = [()] * len(shape)
    for k, d in enumerate(order):  # back to the operand's own dims
        operand[d] = tuple(ins[k])
    return FactorRule(tuple(factors), (tuple(operand),), (tuple(map(tuple, outs)),))


def _along(ctx: RuleContext, whole: set[int], n_scalar_tail: int = 0) -> FactorRule:
    """Operands/results of one rank: dims in ``whole`` differ in size (blocked), others shared."""
    rank = ctx.results[0].ndim
    term = letters(rank)
    main = "".join("." if i in whole else c for i, c in enumerate(term))
    ins = [main if s.ndim == rank else "." * s.ndim for s in ctx.operands]
    return einsum(ctx, ",".join(ins) + "->" + ",".join(main for _ in ctx.results))


@register("concatenate", traits=ASSEMBLY)
def _concatenate(ctx: RuleContext, *, dimension: int, **_: Any) -> FactorRule:
    """The joined dim is a permutation factor: XLA keeps it sharded (an all-to-all per sharded
    operand and of the result) rather than gathering it; of rank one (no other dim for the
    all-to-all to move blocks along) XLA gathers the pieces, and the dim stays whole.

    >>> import numpy as np
    >>> from automap.rules.registry import Shaped
    >>> f32 = np.dtype("float32")
    >>> r = _concatenate(RuleContext("concatenate", (Shaped((4, 32), f32), Shaped((4, 64), f32)),
    ...                              (Shaped((4, 96), f32),)), dimension=1)
    >>> r.factors[1], r.operands, r.results
    (Factor(size=32, kind='permutation'), (((0,), (1,)), ((0,), (1,))), (((0,), (1,)),))
    """
    if ctx.results[0].ndim == 1:
        return _along(ctx, {dimension})
    return _permuted_along(ctx, dimension)


def _permuted_along(ctx: RuleContext, dimension: int) -> FactorRule:
    """Operands and results of one rank sharing every dim; ``dimension``, where their sizes
    differ (pieces laid side by side), a permutation factor, or kept whole where the pieces'
    sizes have no common divisor. (A split's dim stays whole: XLA moves its pieces by
    collective-permutes, but kept sharded it let the estimate put an LSTM's gates, split inside
    its scan, on devices where XLA keeps them whole: the held-out linen LSTM's FSDP memory fell
    to 0.58x XLA's. The estimate prices the permutes: :mod:`automap.split_moves`.)"""
    sizes = [s.shape[dimension] for s in ctx.operands + ctx.results]
    if math.gcd(*sizes) < 2:
        return _along(ctx, {dimension})
    term = letters(ctx.results[0].ndim)
    return einsum(ctx, ",".join(term for _ in ctx.operands) + "->" + ",".join(term for _ in ctx.results),
                  permuted=term[dimension])


@register("pad", traits=PAD)
def _pad(ctx: RuleContext, *, padding_config: Sequence[tuple[int, int, int]], **_: Any) -> FactorRule:
    """Padded dims stay whole, but one whose interior padding spreads the operand evenly (low and
    high padding summing to the interior: ``(0, 1, 1)``, a strided slice's gradient), which
    :func:`_strided` keeps split.

    >>> import numpy as np
    >>> from automap.rules.registry import Shaped
    >>> f32 = np.dtype("float32")
    >>> r = _pad(RuleContext("pad", (Shaped((4, 8), f32), Shaped((), f32)), (Shaped((4, 16), f32),)),
    ...          padding_config=((0, 0, 0), (1, 0, 1)))
    >>> r.operands[0], r.results[0], r.factors[2]
    (((0,), (1,)), ((0,), (1, 2)), Factor(size=2, kind='blocked'))
    """
    every = {i: lo + hi + 1 for i, (lo, hi, interior) in enumerate(padding_config)
             if interior > 0 and lo >= 0 and hi >= 0 and lo + hi == interior}
    return _strided(ctx, {i for i, cfg in enumerate(padding_config) if tuple(cfg) != (0, 0, 0)}, every)


@register("slice", traits=SLICE)
def _slice(ctx: RuleContext, *, strides: Sequence[int] | None = None, **_: Any) -> FactorRule:
    """Sliced dims stay whole, but one that keeps one element of every ``stride`` along the whole
    dim (``x[..., ::2]``, ``x[..., 1::2]``), which :func:`_strided` keeps split.

    >>> import numpy as np
    >>> from automap.rules.registry import Shaped
    >>> f32 = np.dtype("float32")
    >>> r = _slice(RuleContext("slice", (Shaped((4, 16), f32),), (Shaped((4, 8), f32),)), strides=(1, 2))
    >>> r.operands[0], r.results[0], r.factors[2]
    (((0,), (1, 2)), ((0,), (1,)), Factor(size=2, kind='blocked'))
    """
    x, y = ctx.operands[0], ctx.results[0]
    every = {i: s for i, s in enumerate(strides or ()) if s > 1 and x.shape[i] == y.shape[i] * s}
    return _strided(ctx, {i for i, (n, m) in enumerate(zip(x.shape, y.shape)) if n != m}, every)


def _strided(ctx: RuleContext, whole: set[int], every: dict[int, int]) -> FactorRule:
    """:func:`_along`, but a dim ``d`` in ``every`` (its wider side ``every[d]`` times its
    narrower: one element of every ``every[d]`` kept, at one offset) read as digits (kept,
    offset): the kept digit shared by both sides, the offset a blocked digit of the wider side.
    XLA's partitioner runs such a strided slice or interior pad split along the dim with no
    collective (each device's block of ``n`` kept elements is its block of ``n * stride``), where
    the dim whole made the estimate gather it (keras-hub GPT-OSS's gate/up halves
    ``gate_up[..., ::2]``, ``gate_up[..., 1::2]`` and their gradients)."""
    every = {d: s for d, s in every.items() if min(ctx.operands[0].shape[d], ctx.results[0].shape[d]) > 1}
    if not every:
        return _along(ctx, whole)
    rule = _along(ctx, whole)  # the strided dims too: given their digits below
    factors = list(rule.factors)
    operands, results = [list(dims) for dims in rule.operands], [list(dims) for dims in rule.results]
    for d, stride in every.items():
        x, y = ctx.operands[0].shape[d], ctx.results[0].shape[d]
        kept, offset = len(factors), len(factors) + 1
        factors += [Factor(min(x, y)), Factor(stride, "blocked")]
        operands[0][d] = (kept, offset) if x > y else (kept,)
        results[0][d] = (kept, offset) if y > x else (kept,)
    return FactorRule(tuple(factors), tuple(map(tuple, operands)), tuple(map(tuple, results)))


@register("rev", traits=DATA_MOVEMENT)
def _rev(ctx: RuleContext, *, dimensions: Sequence[int], **_: Any) -> FactorRule:
    term = letters(ctx.operands[0].ndim)
    return einsum(ctx, f"{term}->{term}", blocked="".join(term[d] for d in dimensions))


@register("split", traits=SLICE)
def _split(ctx: RuleContext, *, axis: int, **_: Any) -> FactorRule:
    return _along(ctx, {axis % ctx.operands[0].ndim})


@register("iota", traits=RELABEL)
@register("empty", "empty2", traits=ELEMENTWISE)  # uninitialised residuals (e.g. of a cond under grad)
def _iota(ctx: RuleContext, **_: Any) -> FactorRule:
    """No operands: each result dim is its own parallel factor (computed where it lives)."""
    return einsum(ctx, "->" + letters(ctx.results[0].ndim))


@register("stack", traits=ASSEMBLY)
def _stack(ctx: RuleContext, *, axis: int, **_: Any) -> FactorRule:
    """``jnp.stack``: n same-shape operands -> a new dim ``axis`` of size n. The operands share
    every dim with the result; the new dim says which operand an element came from, so (like a
    concatenated dim) it stays whole."""
    rank = ctx.results[0].ndim
    axis %= rank
    term = letters(rank - 1)
    out = term[:axis] + "." + term[axis:]
    return einsum(ctx, ",".join(term for _ in ctx.operands) + f"->{out}")


@register("unstack", traits=DATA_MOVEMENT)
def _unstack(ctx: RuleContext, *, axis: int, **_: Any) -> FactorRule:
    """The inverse of ``stack``: dim ``axis`` disappears (whole), the others are shared."""
    rank = ctx.operands[0].ndim
    axis %= rank
    term = letters(rank - 1)
    return einsum(ctx, f"{term[:axis]}.{term[axis:]}->" + ",".join(term for _ in ctx.results))


@register("tile", traits=ASSEMBLY)
def _tile(ctx: RuleContext, *, reps: Sequence[int], **_: Any) -> FactorRule:
    """``jnp.tile``: result dim ``d`` is ``reps[d] * n`` read as digits ``(rep, n)``: ``n`` is
    the operand's dim (shared), ``rep`` a factor of the result only (each device writes its own
    copies of the whole operand dim). Leading reps beyond the operand's rank are new dims."""
    (x,), (y,) = ctx.operands, ctx.results
    lead = y.ndim - x.ndim
    factors: list[Factor] = []

    def factor(size: int) -> tuple[int, ...]:
        if size == 1:
            return ()
        factors.append(Factor(size))
        return (len(factors) - 1,)

    reps = tuple(reps)
    reps = (1,) * (y.ndim - len(reps)) + reps
    xdims: list[tuple[int, ...]] = []
    ydims: list[tuple[int, ...]] = [factor(y.shape[d]) for d in range(lead)]
    for i, n in enumerate(x.shape):
        rep = factor(reps[lead + i])
        shared = factor(n)
        xdims.append(shared)
        ydims.append(rep + shared)
    return FactorRule(tuple(factors), (tuple(xdims),), (tuple(ydims),))
