"""``logical(annotations, rules)``: a plan seeded from flax logical-axis metadata (MaxText style).

Flax models name the dims of their parameters with *logical* axis names (``("embed", "mlp")``):
``nn.with_logical_partitioning`` in linen, ``out_sharding=`` (formerly ``sharding=``) metadata on
nnx variables. A table of *rules* maps each logical name to a mesh axis (or ``None``, or a tuple
of mesh axes), in priority order, as ``flax.linen.logical_to_mesh_axes`` reads them. This module
resolves every annotated leaf to a mesh ``PartitionSpec`` and hands the result to
:func:`tactics.manual` as exact-path rules, so the parameters are pinned and everything else
(optimizer state, activations, the batch) follows by propagation.
"""
from __future__ import annotations

import re
from typing import Any, Iterable, Sequence

from jax import tree_util
from jax.sharding import PartitionSpec

from automap.trace import path_str
from tactics.manual import Manual

LogicalRules = Sequence[tuple[str, Any]]


def _boxes() -> tuple[type, ...]:
    """Flax's metadata containers (imported lazily, so ``import tactics`` does not load flax)."""
    from flax import nnx
    from flax.core import meta

    return (nnx.Variable, meta.Partitioned)


def _logical_names(leaf: Any) -> tuple | None:
    """The logical names of one annotation leaf (None: not an array, nothing to pin)."""
    from flax import nnx
    from flax.core import meta

    if isinstance(leaf, PartitionSpec):
        return tuple(leaf)
    if isinstance(leaf, meta.Partitioned):  # linen boxes (LogicallyPartitioned included)
        return tuple(leaf.names)
    if isinstance(leaf, nnx.Variable):
        value = leaf.get_value() if hasattr(leaf, "get_value") else leaf.value
        if isinstance(value, PartitionSpec):  # nnx.get_partition_spec(state) output
            return tuple(value)
        names = leaf.get_metadata().get("out_sharding") or leaf.get_metadata().get("sharding")
        if names:
            return tuple(names)
        return () if hasattr(value, "shape") else None
    if hasattr(leaf, "shape"):  # an unannotated array: replicated, as flax.linen.get_partition_spec says
        return ()
    return None


def logical_specs(annotations: Any) -> dict[str, tuple]:
    """Flatten ``annotations`` to ``{key path: logical names}``, paths joined by ``/``.

    ``annotations`` is a pytree of logical ``PartitionSpec`` leaves (``nn.get_partition_spec``), a
    linen variable tree with ``LogicallyPartitioned`` boxes, an nnx ``State`` or ``Module`` (its
    ``nnx.Param`` variables' ``out_sharding`` metadata). A mapping whose only key is ``"params"``
    (a linen variables dict) is unwrapped; an unannotated array leaf has no names (replicated).

    >>> from jax.sharding import PartitionSpec as P
    >>> logical_specs({"params": {"mlp": {"kernel": P("embed", "mlp"), "bias": P("mlp")}}})
    {'mlp/bias': ('mlp',), 'mlp/kernel': ('embed', 'mlp')}
    """
    from flax import nnx

    if isinstance(annotations, nnx.Module):
        annotations = nnx.state(annotations, nnx.Param)
    if hasattr(annotations, "keys") and set(annotations.keys()) == {"params"}:
        annotations = annotations["params"]
    boxes = _boxes()
    flat, _ = tree_util.tree_flatten_with_path(
        annotations, is_leaf=lambda x: isinstance(x, (PartitionSpec,) + boxes)
    )
    out: dict[str, tuple] = {}
    for path, leaf in flat:
        names = _logical_names(leaf)
        if names is not None:
            out[path_str("", path)] = names
    return out


def _mesh_axes(target: Any, name: str) -> tuple[str, ...]:
    if target is None:
        return ()
    if isinstance(target, str):
        return (target,)
    if isinstance(target, (tuple, list)) and all(isinstance(a, str) for a in target):
        return tuple(target)
    raise TypeError(
        f"logical rule ({name!r}, {target!r}): the mesh side must be a mesh axis name, None or a tuple of "
        "mesh axis names"
    )


def to_mesh_spec(names: Iterable[Any], rules: LogicalRules, *, where: str = "value") -> PartitionSpec:
    """One leaf's logical names to a mesh ``PartitionSpec``, with the rules read as flax reads them:
    in order, a rule tiles its logical dim on its mesh axes if the dim is still unassigned and
    none of those mesh axes is used yet by this leaf; dims no rule assigns stay whole. Unlike
    flax, a logical name that appears in no rule is an error (a typo would silently replicate).

    >>> to_mesh_spec(("embed", "mlp"), [("mlp", "model"), ("embed", "model"), ("embed", None)])
    P(None, 'model')
    >>> to_mesh_spec(("batch", None), [("batch", ("data", "fsdp"))])
    P(('data', 'fsdp'), None)
    """
    names = tuple(names)
    known = [name for name, _ in rules]
    for n in names:
        if n is None:
            continue
        if not isinstance(n, str):
            raise ValueError(
                f"logical spec {names} of {where}: entry {n!r} is not a logical axis name or None "
                "(one name per dim)"
            )
        if n not in known:
            raise ValueError(
                f"logical axis name {n!r} of {where} (logical spec {names}) has no rule; the rules are "
                f"{list(rules)}: add ({n!r}, <mesh axis or None>) to the rules"
            )
    dups = sorted({n for n in names if n is not None and names.count(n) > 1})
    if dups:
        raise ValueError(f"logical spec {names} of {where} names {dups} more than once; name each dim once")
    result: list[Any] = [None] * len(names)
    assigned = [n is None for n in names]
    used: set[str] = set()
    for name, target in rules:
        axes = _mesh_axes(target, name)
        if name not in names:
            continue
        pos = names.index(name)
        if assigned[pos] or used & set(axes):
            continue
        assigned[pos] = True
        result[pos] = tuple(target) if isinstance(target, list) else target
        used |= set(axes)
    return PartitionSpec(*result)


def logical(annotations: Any, rules: LogicalRules, *, prefix: str = "state/params") -> Manual:
    """A :func:`tactics.manual` tactic pinning every annotated parameter to the mesh spec its
    logical axis names resolve to under ``rules``.

    ``annotations``: what :func:`logical_specs` accepts (a logical ``PartitionSpec`` tree from
    ``flax.linen.get_partition_spec``, boxed linen variables, an nnx ``State``/``Module``).
    ``rules``: ``(logical name, mesh axis | None | tuple of mesh axes)`` pairs in priority order,
    like flax's ``logical_axis_rules``. ``prefix``: where the tree sits among the step's inputs,
    as automap names them (``state/params`` for a zoo train state ``{"params": ..., ...}``); each
    leaf gets the exact-path rule ``^prefix/key/path$``. Unannotated array leaves are pinned
    replicated. Raises ``ValueError`` for a logical name no rule mentions.

    >>> import jax, jax.numpy as jnp, automap, tactics
    >>> from jax.sharding import PartitionSpec as P
    >>> t = tactics.logical({"w": P("embed", "mlp")}, [("embed", None), ("mlp", "model")], prefix="params")
    >>> t.rules
    (('^params/w$', P(None, 'model')),)
    >>> def step(params, x):
    ...     return {"w": params["w"] * 0.9}, jnp.tanh(x @ params["w"]).sum()
    >>> plan = automap.partition(step, mesh=automap.make_mesh({"model": 2}), tactics=[t]).plan(
    ...     {"w": jnp.ones((4, 8))}, jnp.ones((2, 4)))
    >>> plan.state.partition_spec(plan.program.inputs[0])
    P(None, 'model')
    """
    rules = tuple(rules)
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)):
            raise TypeError(f"logical rule {rule!r}: expected a (logical name, mesh axis or None or tuple) pair")
        _mesh_axes(rule[1], rule[0])
    specs = logical_specs(annotations)
    if not specs:
        raise ValueError(f"logical(): no annotated array leaves found in {type(annotations).__name__}")
    items = []
    for path, names in specs.items():
        full = f"{prefix}/{path}" if prefix else path
        items.append(("^" + re.escape(full) + "$", to_mesh_spec(names, rules, where=f"'{full}'")))
    return Manual(tuple(items), name="logical")
