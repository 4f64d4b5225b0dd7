"""PRNG primitives. Random bits are generated where they live (the partitionable threefry), so
their result dims are parallel factors; key data dims map to the key's."""
from __future__ import annotations

from typing import Any

from automap.rules.registry import FactorRule, RuleContext, einsum, letters, register
from automap.rules.traits import DATA_MOVEMENT, ELEMENTWISE, Traits, output_elements


# fused into its consumers like the threefry hash it lowers to, but its result is stored
@register("random_bits", traits=Traits(output_elements, "loop", "kernel"))
def _random_bits(ctx: RuleContext, **_: Any) -> FactorRule:
    key, out = ctx.operands[0], ctx.results[0]
    term = letters(out.ndim)
    return einsum(ctx, f"{term[:key.ndim]}->{term}")


@register("random_wrap", traits=DATA_MOVEMENT)
def _random_wrap(ctx: RuleContext, **_: Any) -> FactorRule:
    """uint32[..., 2] key data -> key[...]: the trailing key-data dim disappears."""
    out = ctx.results[0]
    term = letters(out.ndim)
    extra = ctx.operands[0].ndim - out.ndim
    return einsum(ctx, f"{term}{'.' * extra}->{term}")


@register("random_unwrap", traits=DATA_MOVEMENT)
def _random_unwrap(ctx: RuleContext, **_: Any) -> FactorRule:
    key = ctx.operands[0]
    term = letters(key.ndim)
    extra = ctx.results[0].ndim - key.ndim
    return einsum(ctx, f"{term}->{term}{'.' * extra}")


@register("random_split", traits=ELEMENTWISE)
def _random_split(ctx: RuleContext, **_: Any) -> FactorRule:
    key, out = ctx.operands[0], ctx.results[0]
    term = letters(out.ndim)
    return einsum(ctx, f"{term[:key.ndim]}->{term}")


@register("random_seed", traits=ELEMENTWISE)
def _random_seed(ctx: RuleContext, **_: Any) -> FactorRule:
    term = letters(ctx.results[0].ndim)
    return einsum(ctx, f"{term}->{term}")
