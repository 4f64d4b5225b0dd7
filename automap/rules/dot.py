"""Contractions: ``dot_general`` is ``b m k, b k n -> b m n`` with ``k`` a reduction factor."""
from __future__ import annotations

from typing import Any

from automap.rules.registry import FactorRule, RuleContext, einsum, letters, register, replicated


@register("dot_general")
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


@register("conv_general_dilated")
def _conv(ctx: RuleContext, *, dimension_numbers: Any, feature_group_count: int = 1,
          batch_group_count: int = 1, **_: Any) -> FactorRule:
    """Batch and output features parallel, input features a reduction, spatial dims whole."""
    if dimension_numbers is None or feature_group_count != 1 or batch_group_count != 1:
        return replicated(ctx)
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    lhs, rhs = ctx.operands
    lterm = ["."] * lhs.ndim
    rterm = ["."] * rhs.ndim
    oterm = ["."] * ctx.results[0].ndim
    lterm[lhs_spec[0]] = oterm[out_spec[0]] = "b"
    lterm[lhs_spec[1]] = rterm[rhs_spec[1]] = "i"
    rterm[rhs_spec[0]] = oterm[out_spec[1]] = "o"
    return einsum(ctx, f"{''.join(lterm)},{''.join(rterm)}->{''.join(oterm)}")
