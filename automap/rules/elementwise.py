"""Elementwise primitives: every dim is one parallel factor shared by operands and results."""
from __future__ import annotations

import dataclasses
from typing import Any

from automap.rules.registry import FactorRule, RuleContext, def_elementwise, einsum, letters, register, replicated
from automap.rules.traits import DATA_MOVEMENT, EXPENSIVE_ELEMENTWISE, RELABEL

def_elementwise(
    # arithmetic
    "add", "add_any", "sub", "mul", "max", "min", "neg", "abs", "sign", "integer_pow", "square", "nextafter",
    # special functions
    "igammac", "igamma_grad_a", "random_gamma_grad", "polygamma", "zeta", "bessel_i0e", "bessel_i1e",
    "regularized_incomplete_beta",
    # rounding and tests
    "floor", "ceil", "round", "is_finite", "reduce_precision",
    # comparisons and logic
    "eq", "ne", "lt", "le", "gt", "ge", "eq_to", "lt_to", "le_to", "and", "or", "not", "xor", "select_n", "clamp",
    "shift_left", "shift_right_logical", "shift_right_arithmetic", "population_count", "clz",
    # complex parts, PRNG hashing
    "real", "imag", "conj", "complex", "threefry2x32", "random_fold_in",
    "mulhi",
    # a placement hint: an identity on the values (the plan decides the placement)
    "reshard",
)
# too costly to recompute in every consumer's fusion: stored when read twice
def_elementwise(
    "div", "rem", "pow", "sqrt", "rsqrt", "cbrt", "atan2", "exp", "exp2", "log", "log1p", "expm1", "tanh",
    "logistic", "sin", "cos", "tan", "asin", "acos", "atan", "sinh", "cosh", "asinh", "acosh", "atanh", "erf",
    "erfc", "erf_inv", "lgamma", "digamma", "igamma",
    traits=EXPENSIVE_ELEMENTWISE,
)
def_elementwise("convert_element_type", traits=RELABEL)
def_elementwise("copy", "copy_p", "sharding_constraint", "stop_gradient", "random_clone", traits=DATA_MOVEMENT)


@register("shard_alike", traits=DATA_MOVEMENT)
def _shard_alike(ctx: RuleContext, **_: Any) -> FactorRule:
    """``shard_alike(x, y)``: two same-shape values the user asks to be sharded alike. Both
    operands and both results share every dim, so a sharding reaching one reaches the other."""
    term = letters(ctx.results[0].ndim)
    return einsum(ctx, f"{term},{term}->{term},{term}")


@register("bitcast_convert_type", traits=DATA_MOVEMENT)
def _bitcast(ctx: RuleContext, **_: Any) -> FactorRule:
    """Same width: elementwise. Otherwise a minor dim appears or vanishes; leading dims are shared."""
    (x,), (y,) = ctx.operands, ctx.results
    common = min(x.ndim, y.ndim)
    term = letters(common)
    lhs = term + "." * (x.ndim - common)
    rhs = term + "." * (y.ndim - common)
    return einsum(ctx, f"{lhs}->{rhs}")


@register("optimization_barrier", "device_put", traits=DATA_MOVEMENT)
def _per_operand_identity(ctx: RuleContext, **_: Any) -> FactorRule:
    """Operand i and result i share every dim (multi-operand identities). The pairs are
    independent values: each is its own group, so one mesh axis may shard all of them."""
    if len(ctx.operands) != len(ctx.results):
        return replicated(ctx)
    used = ""
    ins, outs, groups = [], [], []
    for i, s in enumerate(ctx.operands):
        term = letters(s.ndim, skip=used)
        used += term
        ins.append(term)
        outs.append(term)
        groups += [i] * s.ndim  # einsum numbers factors in order of first appearance
    rule = einsum(ctx, ",".join(ins) + "->" + ",".join(outs))
    return dataclasses.replace(rule, groups=tuple(groups))
