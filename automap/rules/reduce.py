"""Reductions, cumulative ops, sorting: reduced dims are reduction factors, scanned dims blocked."""
from __future__ import annotations

from typing import Any, Sequence

from automap.rules.registry import (
    FactorRule, RuleContext, def_blocked_along, def_reduce, einsum, letters, register, replicated,
)
from automap.rules.traits import (
    ELEMENTWISE, KERNEL, POOLING_GRADIENT, REDUCTION_IN_F32_ON_CPU, WINDOW_REDUCTION, Traits, output_elements,
)

def_reduce("reduce_sum", "reduce_max", "reduce_min", traits=REDUCTION_IN_F32_ON_CPU)
def_reduce("reduce_prod", "reduce_and", "reduce_or", "reduce_xor")
def_blocked_along("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp", param="axis")
def_blocked_along("sort", param="dimension")


@register("argmax", "argmin", traits=KERNEL)
def _arg_reduce(ctx: RuleContext, *, axes: tuple[int, ...], **_: Any) -> FactorRule:
    """The index of the extreme needs the whole reduced dim: it is blocked, the rest shared."""
    term = letters(ctx.operands[0].ndim)
    kept = "".join(c for i, c in enumerate(term) if i not in axes)
    return einsum(ctx, f"{term}->{kept}", blocked="".join(term[i] for i in axes))


@register("top_k", traits=Traits(output_elements, "kernel", "kernel", runs_whole=True))
def _top_k(ctx: RuleContext, **params: Any) -> FactorRule:
    """Rows shared, the searched dim (``axis``, the last by default) and the k picks whole. Shardings propagate through the
    rows, but XLA's SPMD partitioner does not partition ``chlo.top_k``: it gathers the operand
    even when only the rows are sharded and slices the results back (``runs_whole`` prices
    that). A replicated rule stopped the batch there: data_parallel found no batch dim in a
    top-k routed MoE LM (its tokens' flow ended blocked at the router) and left it whole."""
    rank = ctx.operands[0].ndim
    axis = params.get("axis", -1) % rank
    rows = letters(rank - 1, skip="yz")
    operand, result = rows[:axis] + "y" + rows[axis:], rows[:axis] + "z" + rows[axis:]
    return einsum(ctx, f"{operand}->" + ",".join(result for _ in ctx.results), blocked="yz")


@register("approx_top_k", traits=ELEMENTWISE)  # costed as elementwise work
def _approx_top_k(ctx: RuleContext, *, reduction_dimension: int = -1, **_: Any) -> FactorRule:
    """The searched dim has another size in the results and stays whole; the others are shared."""
    return _other_dims_shared(ctx, reduction_dimension)


def _other_dims_shared(ctx: RuleContext, axis: int) -> FactorRule:
    rank = ctx.operands[0].ndim
    term = "".join("." if i == axis % rank else c for i, c in enumerate(letters(rank)))
    return einsum(ctx, ",".join(term for _ in ctx.operands) + "->" + ",".join(term for _ in ctx.results))


@register("reduce", traits=ELEMENTWISE)  # costed as elementwise work
def _reduce(ctx: RuleContext, *, dimensions: Sequence[int], **_: Any) -> FactorRule:
    """A variadic reduction with a user computation (operands, then their scalar init values):
    XLA has no collective for an arbitrary reducer, so the reduced dims stay whole."""
    n = len(ctx.results)
    rank = ctx.operands[0].ndim
    term = letters(rank)
    kept = "".join(c for i, c in enumerate(term) if i not in set(dimensions))
    ins = [term] * n + ["" for _ in ctx.operands[n:]]
    return einsum(ctx, ",".join(ins) + "->" + ",".join(kept for _ in ctx.results),
                  blocked="".join(term[d] for d in dimensions))


def _window_term(rank: int, windowed: set[int]) -> str:
    return "".join("." if i in windowed else c for i, c in enumerate(letters(rank)))


def _windowed(window_dimensions: Sequence[int], window_strides: Sequence[int], padding: Sequence[Any],
              base_dilation: Sequence[int] | None = None, window_dilation: Sequence[int] | None = None) -> set[int]:
    """Dims a window really slides over (anything but size 1, stride 1, no padding, no dilation)."""
    n = len(window_dimensions)
    base_dilation = base_dilation or (1,) * n
    window_dilation = window_dilation or (1,) * n
    return {
        i for i in range(n)
        if (window_dimensions[i], window_strides[i], tuple(padding[i]), base_dilation[i], window_dilation[i])
        != (1, 1, (0, 0), 1, 1)
    }


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window", traits=WINDOW_REDUCTION)
def _reduce_window(ctx: RuleContext, *, window_dimensions: Sequence[int], window_strides: Sequence[int],
                   padding: Sequence[Any], base_dilation: Sequence[int] | None = None,
                   window_dilation: Sequence[int] | None = None, **_: Any) -> FactorRule:
    """Pooling: dims a window slides over stay whole (a halo exchange at best); the rest shared.
    The generic ``reduce_window`` takes its scalar init values after the operands."""
    rank = ctx.results[0].ndim
    term = _window_term(rank, _windowed(window_dimensions, window_strides, padding, base_dilation, window_dilation))
    ins = [term if s.ndim == rank else "." * s.ndim for s in ctx.operands]
    return einsum(ctx, ",".join(ins) + "->" + ",".join(term for _ in ctx.results))


@register("select_and_scatter_add", "select_and_scatter", traits=POOLING_GRADIENT)
@register("select_and_gather_add", traits=KERNEL)  # a reduce-window over (value, tangent) pairs
def _select_and_window(ctx: RuleContext, *, window_dimensions: Sequence[int], window_strides: Sequence[int],
                       padding: Sequence[Any], base_dilation: Sequence[int] | None = None,
                       window_dilation: Sequence[int] | None = None, **_: Any) -> FactorRule:
    """The gradients of max pooling (and the generic ``select_and_scatter``, whose scalar init
    value comes last): the pooled and the input shapes share the unwindowed dims."""
    rank = ctx.results[0].ndim
    term = _window_term(rank, _windowed(window_dimensions, window_strides, padding, base_dilation, window_dilation))
    ins = [term if s.ndim == rank else "." * s.ndim for s in ctx.operands]
    return einsum(ctx, ",".join(ins) + "->" + ",".join(term for _ in ctx.results))
