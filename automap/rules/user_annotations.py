"""Rules for what the user wrote into the program about its own partitioning or rematerialisation.

- ``name`` (``jax.ad_checkpoint.checkpoint_name``): an identity that labels a value for named remat
  policies; every dim passes through. Emission replays it, so ``save_only_these_names`` and the
  other named policies still find their names in the replayed program.
- ``shard_alike(x, y)``: both operands and both results share every dim's factor.
- ``shard_map``: the user chose the shardings at its boundary. Its rule gives every dim named in
  ``in_specs``/``out_specs`` a factor of its own and blocks the others (the body sees them whole)
  when every mesh axis is manual; nothing ties operands to results (the body is opaque).
  :func:`fix_user_shardings` then applies the specs as the plan's *first* actions and freezes
  those values, so propagation fills the rest of the program around them and never changes them;
  tactics skip them ("pinned by an earlier tactic"), and where a later decision wants another
  spec the cost model prices the resharding, as for any disagreement.
- ``custom_partitioning``: its ``sharding_rule`` (Shardy's einsum-like rule, required by JAX's
  default partitioner) becomes the factor rule, factors found only in operands blocked (the
  user's ``partition`` callback decides what a sharded contraction means); without a rule every
  dim stays whole.

>>> import jax, jax.numpy as jnp
>>> from automap.ir.lower import lower
>>> from jax.ad_checkpoint import checkpoint_name
>>> prog = lower(jax.make_jaxpr(lambda x: checkpoint_name(x * 2, "h"))(jnp.ones((8, 4))), ["x"], ["y"])
>>> [(op.primitive, op.has_rule) for op in prog.ops]
[('mul', True), ('name', True)]
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence

from automap import _compat
from automap.rules.registry import DimFactors, Factor, FactorRule, RuleContext, def_elementwise, register
from automap.rules.traits import RELABEL, UNKNOWN

def_elementwise("name", traits=RELABEL)  # checkpoint_name: an identity the remat policy reads (shard_alike: elementwise.py)


def _dims_of_spec(spec: Any, ndim: int, factors: list[Factor], sizes: Sequence[int], block: bool) -> tuple:
    """One factor per dim named in ``spec``; the others blocked (``block``) or free."""
    entries = list(spec) + [None] * (ndim - len(spec))
    out: list[DimFactors] = []
    for entry, size in zip(entries, sizes, strict=True):
        factors.append(Factor(size, "blocked" if entry is None and block else "parallel"))
        out.append((len(factors) - 1,))
    return tuple(out)


@register("shard_map", traits=UNKNOWN)  # its body is opaque to the cost model
def _shard_map(ctx: RuleContext, *, in_specs: Sequence[Any], out_specs: Sequence[Any], mesh: Any, **params: Any):
    manual = _compat.shard_map_manual_axes(params, mesh)
    block = set(manual) >= set(mesh.axis_names)
    factors: list[Factor] = []
    ops = tuple(_dims_of_spec(p, s.ndim, factors, s.shape, block) for p, s in zip(in_specs, ctx.operands, strict=True))
    res = tuple(_dims_of_spec(p, s.ndim, factors, s.shape, block) for p, s in zip(out_specs, ctx.results, strict=True))
    return FactorRule(tuple(factors), ops, res)


@register("custom_partitioning", traits=UNKNOWN)  # the user's kernel: opaque
def _custom_partitioning(ctx: RuleContext, *, sharding_rule: Any = None, **_: Any) -> FactorRule:
    index: dict[str, int] = {}
    factors: list[Factor] = []
    in_results = {f for m in getattr(sharding_rule, "result_mappings", ()) for dim in m for f in _names(dim)}

    def dims(mappings: Sequence[Any] | None, shapes: Sequence[Any]) -> tuple:
        out = []
        for k, s in enumerate(shapes):
            mapping = mappings[k] if mappings is not None else [()] * s.ndim
            row: list[DimFactors] = []
            for dim, size in zip(mapping, s.shape, strict=True):
                names = _names(dim)
                if len(names) != 1:  # compound or special dims: not sharded by automap
                    factors.append(Factor(size, "blocked"))
                    row.append((len(factors) - 1,))
                    continue
                if names[0] not in index:
                    index[names[0]] = len(factors)
                    factors.append(Factor(size, "parallel" if names[0] in in_results else "blocked"))
                row.append((index[names[0]],))
            out.append(tuple(row))
        return tuple(out)

    ops = dims(getattr(sharding_rule, "operand_mappings", None), ctx.operands)
    res = dims(getattr(sharding_rule, "result_mappings", None), ctx.results)
    return FactorRule(tuple(factors), ops, res)


def _names(dim: Any) -> tuple[str, ...]:
    if isinstance(dim, str):
        return (dim,)
    return tuple(d for d in dim if isinstance(d, str)) if isinstance(dim, (tuple, list)) else ()


def user_specs(program: Any) -> list[tuple[int, Any, str]]:
    """``(value id, PartitionSpec, label)`` for every operand and result of a ``shard_map`` in
    ``program`` (regions included), in program order."""
    out: list[tuple[int, Any, str]] = []

    def visit(ops: Iterable[Any]) -> None:
        for op in ops:
            for region in op.regions:
                visit(region.ops)
            if op.primitive != "shard_map":
                continue
            label = f"shard_map at {op.source}"
            for vid, spec in zip(op.inputs, op.params["in_specs"], strict=True):
                out.append((vid, spec, f"{label}: in_specs"))
            for vid, spec in zip(op.outputs, op.params["out_specs"], strict=True):
                out.append((vid, spec, f"{label}: out_specs"))

    visit(program.ops)
    return out


def fix_user_shardings(state: Any) -> Any:
    """``state`` with every ``shard_map`` boundary value tiled as its specs say and frozen (the
    plan's first decisions, so that everything else propagates around them).

    >>> import jax, jax.numpy as jnp, automap
    >>> from jax.sharding import PartitionSpec as P
    >>> from automap.ir.lower import lower
    >>> from automap.shardings import ShardingState
    >>> mesh = automap.make_mesh({"data": 2})
    >>> f = jax.shard_map(lambda a: a * 2, mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    >>> prog = lower(jax.make_jaxpr(lambda x: jnp.tanh(f(x)))(jnp.ones((8, 4))), ["x"], ["y"])
    >>> fixed = fix_user_shardings(ShardingState.initial(prog, {"data": 2}))
    >>> fixed.spec(prog.inputs[0]), fixed.spec(prog.outputs[0])
    ((('data',), ()), (('data',), ()))
    """
    from automap.propagate import apply
    from automap.shardings import ShardingError, actions_for, from_partition_spec

    for vid, pspec, label in user_specs(state.program):
        value = state.program.values[vid]
        if vid in state.frozen or value.kind in ("literal", "const"):
            continue  # a value two shard_maps read: the first one's spec stands, the other reshards
        spec = from_partition_spec(pspec, value.ndim, where=f"value '{value.name}'")
        unknown = {a for dim in spec for a in dim} - set(state.axes)
        if unknown:
            raise ShardingError(
                f"{label} shards value '{value.name}' over mesh axes {sorted(unknown)}, which the automap mesh "
                f"{dict(state.axes)} does not have: give shard_map and automap the same mesh"
            )
        if any(dim for dim in state.spec(vid)):
            continue
        state = apply(state, actions_for(vid, spec), freeze=(vid,), label=label)
    return state
