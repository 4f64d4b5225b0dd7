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
    "name": ("jaxpr",),
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


def auto_mesh(shape: tuple[int, ...], names: tuple[str, ...], devices: Any = None) -> jax.sharding.Mesh:
    """A mesh whose axes are all ``AxisType.Auto`` (flax models fail to trace under Explicit)."""
    kwargs: dict[str, Any] = {}
    if devices is not None:
        kwargs["devices"] = devices
    axis_types = (jax.sharding.AxisType.Auto,) * len(names)
    return jax.make_mesh(shape, names, axis_types=axis_types, **kwargs)
