"""Reductions, cumulative ops, sorting: reduced dims are reduction factors, scanned dims blocked."""
from __future__ import annotations

from typing import Any

from automap.rules.registry import (
    FactorRule, RuleContext, def_blocked_along, def_reduce, einsum, letters, register,
)

def_reduce("reduce_sum", "reduce_max", "reduce_min", "reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def_blocked_along("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", param="axis")
def_blocked_along("sort", param="dimension")


@register("argmax", "argmin")
def _arg_reduce(ctx: RuleContext, *, axes: tuple[int, ...], **_: Any) -> FactorRule:
    """The index of the extreme needs the whole reduced dim: it is blocked, the rest shared."""
    term = letters(ctx.operands[0].ndim)
    kept = "".join(c for i, c in enumerate(term) if i not in axes)
    return einsum(ctx, f"{term}->{kept}", blocked="".join(term[i] for i in axes))


@register("top_k")
def _top_k(ctx: RuleContext, **_: Any) -> FactorRule:
    """Leading dims shared; the last (sorted) dim stays whole."""
    term = letters(ctx.operands[0].ndim - 1) + "."
    return einsum(ctx, f"{term}->" + ",".join(term for _ in ctx.results))
