"""Contractions (``dot_general`` is ``b m k, b k n -> b m n`` with ``k`` a reduction factor, conv),
batched linear algebra (batch dims shared, matrix dims whole) and FFTs."""
from __future__ import annotations

import math
from typing import Any

from automap.rules.registry import Factor, FactorRule, RuleContext, einsum, letters, register, replicated
from automap.rules.traits import ELEMENTWISE, contraction


def _dot_contracted(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    (lc, rc), _ = dimension_numbers
    return tuple(lc), tuple(rc)


def _conv_contracted(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> tuple[tuple[int, ...], ...]:
    """The input features and the window's spatial dims."""
    if dimension_numbers is None:
        return (), ()
    lhs_spec, rhs_spec, _ = dimension_numbers
    return tuple(lhs_spec[1:]), tuple(rhs_spec[1:])


def _conv_flops(ctx: RuleContext, **_: Any) -> int:
    """``2 * |result| * |kernel| / out_features`` (the kernel's last dim taken as its outputs)."""
    rhs, out = ctx.operands[1].shape, ctx.results[0].shape
    return 2 * math.prod(out) * math.prod(rhs) // max(rhs[-1], 1)


@register("dot_general", traits=contraction(_dot_contracted))
def _dot_general(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> FactorRule:
    (lc, rc), (lb, rb) = dimension_numbers
    lhs, rhs = ctx.operands
    pool = iter(letters(lhs.ndim + rhs.ndim))
    lterm = [""] * lhs.ndim
    rterm = [""] * rhs.ndim
    batch = []
    for i, j in zip(lb, rb, strict=True):
        c = next(pool)
        lterm[i] = rterm[j] = c
        batch.append(c)
    for i, j in zip(lc, rc, strict=True):
        c = next(pool)
        lterm[i] = rterm[j] = c
    lfree = []
    for i in range(lhs.ndim):
        if not lterm[i]:
            lterm[i] = next(pool)
            lfree.append(lterm[i])
    rfree = []
    for j in range(rhs.ndim):
        if not rterm[j]:
            rterm[j] = next(pool)
            rfree.append(rterm[j])
    out = "".join(batch + lfree + rfree)
    return einsum(ctx, f"{''.join(lterm)},{''.join(rterm)}->{out}")


# a contraction, but its windows make it no matmul for the tactics (and its FLOPs no dot FLOPs)
@register("conv_general_dilated", traits=contraction(_conv_contracted, kind="convolution", flops=_conv_flops))
def _conv(ctx: RuleContext, *, dimension_numbers: Any, feature_group_count: int = 1,
          batch_group_count: int = 1, **_: Any) -> FactorRule:
    """Batch and output features parallel, input features a reduction, spatial dims whole.

    With ``G = feature_group_count`` groups the feature dims are ``(g, ci)`` (input), ``(g, og)``
    (kernel output and output) and ``ci`` (kernel input). A depthwise conv (``ci == 1``) is
    parallel in its groups ``g``: its channels stay split. XLA partitions no other grouped conv,
    not even along its batch (it gathers the operands), so those stay whole."""
    if dimension_numbers is None or batch_group_count != 1:
        return replicated(ctx)
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs, rhs = ctx.operands
    out = ctx.results[0]
    groups = feature_group_count
    if groups > 1 and rhs.shape[rhs_spec[1]] > 1:
        return replicated(ctx)
    factors: list[Factor] = []

    def factor(size: int, kind: str = "parallel") -> tuple[int, ...]:
        if size == 1:
            return ()
        factors.append(Factor(size, kind))  # type: ignore[arg-type]
        return (len(factors) - 1,)

    b = factor(lhs.shape[lhs_spec[0]])
    g = factor(groups)
    ci = factor(rhs.shape[rhs_spec[1]], "reduction")
    og = factor(rhs.shape[rhs_spec[0]] // groups)
    ldims: list[tuple[int, ...]] = [() for _ in lhs.shape]
    rdims: list[tuple[int, ...]] = [() for _ in rhs.shape]
    odims: list[tuple[int, ...]] = [() for _ in out.shape]
    ldims[lhs_spec[0]] = odims[out_spec[0]] = b
    ldims[lhs_spec[1]] = g + ci
    rdims[rhs_spec[1]] = ci
    rdims[rhs_spec[0]] = odims[out_spec[1]] = g + og
    return FactorRule(tuple(factors), (tuple(ldims), tuple(rdims)), (tuple(odims),))


def _batched(ctx: RuleContext, core: int) -> FactorRule:
    """Leading (batch) dims shared by every operand and result; the ``core`` trailing dims of
    operand 0 (a matrix, a vector) stay whole."""
    nbatch = max(ctx.operands[0].ndim - core, 0)
    batch_shape = ctx.operands[0].shape[:nbatch]
    term = letters(nbatch)

    def value_term(s: Any) -> str:
        if s.shape[:nbatch] != batch_shape:
            return "." * s.ndim
        return term + "." * (s.ndim - nbatch)

    return einsum(ctx, ",".join(map(value_term, ctx.operands)) + "->" + ",".join(map(value_term, ctx.results)))


@register("cholesky", "eig", "eigh", "lu", "qr", "svd", "hessenberg", "schur", "householder_product",
          "tridiagonal", "triangular_solve", traits=ELEMENTWISE)  # costed as elementwise work
def _linalg(ctx: RuleContext, **_: Any) -> FactorRule:
    """Batched matrix decompositions and solves: batch dims shared, matrix dims whole (XLA
    partitions only the batch dims, e.g. not the independent columns of a triangular solve)."""
    return _batched(ctx, 2)


@register("tridiagonal_solve", traits=ELEMENTWISE)
def _tridiagonal_solve(ctx: RuleContext, **_: Any) -> FactorRule:
    return _batched(ctx, 1)  # dl, d, du are (..., m); b is (..., m, n)


@register("fft", traits=ELEMENTWISE)
def _fft(ctx: RuleContext, **_: Any) -> FactorRule:
    """Whole. Its leading dims are independent, but XLA's SPMD partitioner gathers an FFT's
    operand even when only those are sharded; a replicated rule prices that gather."""
    return replicated(ctx)
