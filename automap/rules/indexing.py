"""Indexing: gather (embedding lookups), scatter(-add) (their gradients), dynamic slices.

A dim that is *indexed* can still be sharded: each device looks up the rows it holds and
contributes zeros elsewhere, so for gather the indexed dim is a reduction factor (a partial
sum, all-reduced: the vocab-parallel embedding of Megatron), and for scatter-add it is a
parallel factor of operand and result while the update's batch dims are reductions.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from automap.rules.registry import FactorRule, RuleContext, einsum, letters, register
from automap.rules.traits import CPU_BF16_IN_F32, LOOKUP, SCATTER, SLICE, UPDATE


@register("gather", traits=LOOKUP)
def _gather(ctx: RuleContext, *, dimension_numbers: Any, slice_sizes: Any, **_: Any) -> FactorRule:
    operand, indices = ctx.operands
    out = ctx.results[0]
    dn = dimension_numbers
    offset_dims = tuple(dn.offset_dims)
    collapsed = set(dn.collapsed_slice_dims)
    indexed = set(dn.start_index_map)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "start_indices_batching_dims", ()))
    pool = iter(letters(operand.ndim + indices.ndim + out.ndim))
    oterm = ["."] * out.ndim
    iterm = ["."] * indices.ndim
    pterm = ["."] * operand.ndim
    batch_out = [d for d in range(out.ndim) if d not in offset_dims]
    for idim, odim in zip(range(indices.ndim - 1), batch_out, strict=True):
        c = next(pool)
        iterm[idim] = oterm[odim] = c
    for pd, idim in zip(op_batch, idx_batch, strict=True):
        pterm[pd] = iterm[idim]
    window = [d for d in range(operand.ndim) if d not in collapsed and d not in op_batch]
    for pd, odim in zip(window, offset_dims, strict=True):
        # a whole-dim slice passes the dim through, even when indexed (its start clamps to 0:
        # ``weight[i]`` under vmap indexes every dim of the table)
        if slice_sizes[pd] == operand.shape[pd]:
            c = next(pool)
            pterm[pd] = oterm[odim] = c
    for pd in indexed:
        # one row looked up, its dim dropped (collapsed) or kept with size 1: a reduction factor,
        # in no result
        if slice_sizes[pd] == 1 and pterm[pd] == ".":
            pterm[pd] = next(pool)
    return einsum(ctx, f"{''.join(pterm)},{''.join(iterm)}->{''.join(oterm)}")


def _scatter_rule(ctx: RuleContext, dn: Any, combine: bool) -> FactorRule:
    operand, indices, updates = ctx.operands[:3]
    update_window = tuple(dn.update_window_dims)
    inserted = set(dn.inserted_window_dims)
    op_batch = tuple(getattr(dn, "operand_batching_dims", ()))
    idx_batch = tuple(getattr(dn, "scatter_indices_batching_dims", ()))
    pool = iter(letters(operand.ndim + indices.ndim + updates.ndim))
    pterm = [next(pool) for _ in range(operand.ndim)]
    iterm = ["."] * indices.ndim
    uterm = ["."] * updates.ndim
    scatter_dims = dict(zip(range(indices.ndim - 1), (d for d in range(updates.ndim) if d not in update_window),
                            strict=True))  # index dim -> the updates' dim it runs along
    for idim, ud in scatter_dims.items():
        iterm[idim] = uterm[ud] = next(pool)
    for pd, idim in zip(op_batch, idx_batch, strict=True):  # a batch dim: operand, indices and updates alike
        iterm[idim] = uterm[scatter_dims[idim]] = pterm[pd]
    # overwriting scatters cannot sum partial results: their scattered dims stay whole
    blocked = "" if combine else "".join(iterm[i] for i in scatter_dims if i not in idx_batch)
    window = [d for d in range(operand.ndim) if d not in inserted and d not in op_batch]
    for pd, ud in zip(window, update_window, strict=True):
        # a whole-dim window passes the dim through, even when indexed (as at a gather)
        if updates.shape[ud] == operand.shape[pd]:
            uterm[ud] = pterm[pd]
    terms = [''.join(pterm), ''.join(iterm), ''.join(uterm)]
    return einsum(ctx, ",".join(terms) + "->" + ",".join(''.join(pterm) for _ in ctx.results), blocked=blocked)


@register("scatter-sub", "scatter-mul", "scatter-min", "scatter-max", "scatter_sub", "scatter_mul", "scatter_min", "scatter_max",
          traits=SCATTER)
@register("scatter-add", "scatter_add",  # embedding gradients; XLA:CPU adds bf16 in f32 (partial sums moved in f32)
          traits=dataclasses.replace(SCATTER, emit="pin", platform_upcast=CPU_BF16_IN_F32))
def _scatter_combine(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> FactorRule:
    return _scatter_rule(ctx, dimension_numbers, combine=True)


@register("scatter", traits=SCATTER)
def _scatter(ctx: RuleContext, *, dimension_numbers: Any, **_: Any) -> FactorRule:
    return _scatter_rule(ctx, dimension_numbers, combine=False)


@register("dynamic_slice", traits=SLICE)
def _dynamic_slice(ctx: RuleContext, *, slice_sizes: Any, **_: Any) -> FactorRule:
    x = ctx.operands[0]
    term = "".join(c if slice_sizes[i] == x.shape[i] else "." for i, c in enumerate(letters(x.ndim)))
    return einsum(ctx, ",".join([term] + ["" for _ in ctx.operands[1:]]) + f"->{term}")


@register("dynamic_update_slice", traits=UPDATE)
def _dynamic_update_slice(ctx: RuleContext, **_: Any) -> FactorRule:
    x, upd = ctx.operands[:2]
    full = letters(x.ndim)
    uterm = "".join(c if upd.shape[i] == x.shape[i] else "." for i, c in enumerate(full))
    blocked = "".join(c for i, c in enumerate(full) if upd.shape[i] != x.shape[i])
    rest = ["" for _ in ctx.operands[2:]]
    return einsum(ctx, ",".join([full, uterm] + rest) + f"->{full}", blocked=blocked)
