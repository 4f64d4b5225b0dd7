"""The one place that knows about differences between JAX versions (tested on jax 0.10.x)."""
from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.extend import core as jex_core
from jax.extend import source_info_util

Literal = jex_core.Literal
Var = jex_core.Var
ClosedJaxpr = jex_core.ClosedJaxpr
Jaxpr = jex_core.Jaxpr

# primitive names of calls that are inlined, with the param holding their body
INLINE_CALLS: dict[str, tuple[str, ...]] = {
    "jit": ("jaxpr",),
    "pjit": ("jaxpr",),
    "closed_call": ("call_jaxpr",),
    "core_call": ("call_jaxpr",),
    "custom_jvp_call": ("call_jaxpr",),
    "custom_vjp_call": ("call_jaxpr", "fun_jaxpr"),
    "custom_vjp_call_jaxpr": ("fun_jaxpr",),
    "remat2": ("jaxpr",),
    "checkpoint": ("jaxpr",),
}
REMAT_PRIMITIVES = frozenset({"remat2", "checkpoint"})


def inline_body(eqn: Any) -> tuple[Jaxpr, list[Any]]:
    """The (open jaxpr, consts) of an inlinable call equation."""
    for key in INLINE_CALLS[eqn.primitive.name]:
        body = eqn.params.get(key)
        if body is None:
            continue
        if isinstance(body, ClosedJaxpr) or hasattr(body, "consts"):
            return body.jaxpr, list(body.consts)
        return body, []
    raise KeyError(f"cannot find the body of '{eqn.primitive.name}' in params {sorted(eqn.params)}")


def closed_parts(body: Any) -> tuple[Jaxpr, list[Any]]:
    if hasattr(body, "consts"):
        return body.jaxpr, list(body.consts)
    return body, []


def itemsize(dtype: Any) -> int:
    """Bytes per element, also for extended dtypes (PRNG keys: their key data)."""
    try:
        return int(np.dtype(dtype).itemsize)
    except TypeError:
        impl = getattr(dtype, "_impl", None)
        shape = getattr(impl, "key_shape", (2,))
        return 4 * int(np.prod(shape))


def source_of(eqn: Any) -> str:
    try:
        return source_info_util.summarize(eqn.source_info)
    except Exception:  # pragma: no cover - depends on the JAX version
        return "?"


def name_stack_of(eqn: Any) -> str:
    return str(getattr(eqn.source_info, "name_stack", ""))


def is_literal(atom: Any) -> bool:
    return isinstance(atom, Literal)


def replay_eqn(eqn: Any, args: list[Any]) -> list[Any]:
    """Apply ``eqn``'s primitive to ``args`` (values or tracers); always a list of results.

    First-order primitives are bound directly. Higher-order ones (``shard_map``,
    ``custom_partitioning``, anything with a jaxpr in its params) take other arguments in
    ``bind`` than the params they record, so they are evaluated as a one-equation jaxpr with
    JAX's own evaluator (``jax.extend.core.jaxpr_as_fun``), which knows how to re-bind each.
    """
    if not jex_core.jaxprs_in_params(eqn.params):
        out = eqn.primitive.bind(*args, **eqn.params)
        return list(out) if eqn.primitive.multiple_results else [out]
    invars = [Var(a.aval) for a in eqn.invars]  # literals too: every operand comes from args
    outvars = [Var(v.aval) for v in eqn.outvars]
    one = jex_core.new_jaxpr_eqn(invars, outvars, eqn.primitive, eqn.params, eqn.effects, eqn.source_info)
    paths = tuple(f"result[{i}]" for i in range(len(outvars)))
    info = jax.api_util.debug_info(f"automap replay of {eqn.primitive}", lambda *a: None, tuple(args), {},
                                   result_paths_thunk=lambda: paths)
    jaxpr = Jaxpr((), invars, outvars, [one], eqn.effects, debug_info=info)  # without: a DeprecationWarning
    return list(jex_core.jaxpr_as_fun(ClosedJaxpr(jaxpr, ()))(*args))


def auto_view(mesh: jax.sharding.Mesh) -> jax.sharding.Mesh:
    """``mesh`` with every axis ``AxisType.Auto`` (the same devices and axis names); ``mesh``
    itself when its axes are Auto already."""
    auto = jax.sharding.AxisType.Auto
    if all(t == auto for t in mesh.axis_types):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names, axis_types=(auto,) * len(mesh.axis_names))


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any = None) -> jax.sharding.Mesh:
    """A mesh whose axes are all ``AxisType.Auto`` (flax models fail to trace under Explicit)."""
    kwargs: dict[str, Any] = {}
    if devices is not None:
        kwargs["devices"] = devices
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=axis_types, **kwargs)


def shard_map_manual_axes(params: dict, mesh: Any) -> frozenset[str]:
    """The mesh axes a ``shard_map`` equation makes manual (jax 0.10: ``newly_manual_axes``;
    older: every axis not in ``auto``)."""
    if "newly_manual_axes" in params:
        return frozenset(params["newly_manual_axes"])
    if "axis_names" in params:
        return frozenset(params["axis_names"])
    return frozenset(mesh.axis_names) - frozenset(params.get("auto", ()))


def planning_mesh_context(mesh: jax.sharding.Mesh) -> Any:
    """A context in which automap traces and runs for ``mesh`` (its Auto view): when the caller
    has set a mesh (``with jax.set_mesh(...)``, possibly with Explicit axes), it is replaced by
    the Auto view for the duration; otherwise nothing changes."""
    import contextlib

    if jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    return jax.set_mesh(auto_view(mesh))
