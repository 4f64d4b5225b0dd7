"""Primitives that stay whole on purpose, each with the reason (shown in ``Plan.report()``).

Their rule is :func:`~automap.rules.registry.replicated`: operands are gathered before the op
and its results are whole, which is what JAX itself does for them. They raise no
``MissingRuleWarning``: this is a decision, not a gap. ``UNREACHABLE`` lists the primitives
JAX registers that never reach a factor rule in a traced step, and why.
"""
from __future__ import annotations

from typing import Any

from automap.rules.registry import Factor, FactorRule, RuleContext, register, replicated
from automap.rules.traits import DATA_MOVEMENT, UNKNOWN

UNSHARDABLE: dict[str, str] = {
    "debug_callback": "host callback (jax.debug.callback): the host function receives whole arrays",
    "debug_print": "host callback (jax.debug.print): prints whole arrays",
    "pure_callback": "host callback (jax.pure_callback): the host function takes and returns whole arrays",
    "io_callback": "host callback (jax.experimental.io_callback): the host function takes and returns whole arrays",
    "ffi_call": "foreign function (jax.ffi.ffi_call): an opaque kernel XLA cannot partition",
    "layout_constraint": "XLA's SPMD partitioner gathers the operand of a layout constraint (checked on jax 0.10.2)",
    "rng_uniform": "XLA's stateful RngUniform: a shard would draw other numbers",
    "create_token": "an ordering token: no array dims",
    "after_all": "an ordering token: no array dims",
}

UNREACHABLE: dict[str, str] = {
    **{p: "a named-axis collective: valid only inside shard_map / pmap bodies, which automap does not partition"
       for p in ("psum", "pmax", "pmin", "ppermute", "all_gather", "all_to_all", "axis_index", "ragged_all_to_all",
                 "reduce_scatter", "pbroadcast", "psum_invariant", "all_gather_invariant", "pvary", "psend", "precv",
                 "unreduced_psum", "unreduced_reduce_scatter", "all_gather_reduced", "preduced")},
    **{p: "a mutable-array (Ref) primitive: automap traces functional steps; JAX discharges refs in a jit"
       for p in ("get", "swap", "addupdate", "new_ref", "free_ref", "freeze", "empty_ref", "accum_grad_in_ref")},
    "custom_lin": "internal to jax.linearize: never in a traced jaxpr",
    "call": "core.call_p: JAX's tracing emits jit / closed_call instead (inlined)",
    "stage": "internal to jax's staging of pipelines: never in a traced step",
}


def _whole(ctx: RuleContext, **_: Any) -> FactorRule:
    return replicated(ctx)


register(*UNSHARDABLE, traits=UNKNOWN)(_whole)  # opaque work: its own kernel, buffers in and out


@register("inspect_sharding", "dce_sink", traits=DATA_MOVEMENT)
def _inspect_sharding(ctx: RuleContext, **_: Any) -> FactorRule:
    """Ops without results that look at their operand as it is placed
    (``jax.debug.inspect_array_sharding``; ``dce_sink``, which only keeps it alive): every
    operand dim is a free parallel factor (nothing is gathered or reduced)."""
    factors = tuple(Factor(n) for s in ctx.operands for n in s.shape)
    dims, i = [], 0
    for s in ctx.operands:
        dims.append(tuple((i + d,) for d in range(s.ndim)))
        i += s.ndim
    return FactorRule(factors, tuple(dims), tuple(() for _ in ctx.results))
