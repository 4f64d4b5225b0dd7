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


@register("random_gamma", traits=Traits(output_elements, "kernel", "kernel"))  # a rejection loop per element
def _random_gamma(ctx: RuleContext, **_: Any) -> FactorRule:
    """``random_gamma(keys, alpha)``: the keys' dims lead alpha's and draw independently (shared,
    parallel); alpha's trailing dims get keys split from one key by count, so they stay whole
    (a shard would split into other keys and draw other numbers)."""
    key, alpha = ctx.operands
    term = letters(key.ndim)
    rest = "." * (alpha.ndim - key.ndim)
    return einsum(ctx, f"{term},{term}{rest}->{term}{rest}")


@register("rng_bit_generator", traits=Traits(output_elements, "loop", "kernel"))
def _rng_bit_generator(ctx: RuleContext, **_: Any) -> FactorRule:
    """XLA's stateful generator: one state makes the whole block of bits, so the state and both
    results stay whole (a shard of the bits would come from another stream)."""
    key, (new_key, bits) = ctx.operands[0], ctx.results
    return einsum(ctx, "." * key.ndim + "->" + "." * new_key.ndim + "," + "." * bits.ndim)
