"""Arguments onto the plan's shardings before a call, outputs onto the user's mesh after it.

automap plans and runs on an ``AxisType.Auto`` view of the user's mesh (same devices, same axis
names; see :func:`automap._compat.auto_view`). An argument already laid out as the plan wants, on
either view, is passed as it is; outputs are returned on the user's own mesh, so that with
Explicit axes their types carry the plan's shardings, as ``jax.jit``'s outputs would.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import tree_util
from jax.sharding import Mesh, NamedSharding

from automap import _compat


def place(x: Any, sharding: NamedSharding, path: str = "") -> Any:
    """``x`` on ``sharding``: moved only when its layout differs.

    >>> import jax.numpy as jnp, automap
    >>> s = NamedSharding(automap.make_mesh({"data": 1}), jax.sharding.PartitionSpec())
    >>> place(jnp.ones(2), s).sharding == s
    True
    """
    if isinstance(x, jax.ShapeDtypeStruct):
        raise TypeError(
            f"cannot run on jax.ShapeDtypeStruct argument '{path}': pass arrays (use .plan() or .lower() to plan only)"
        )
    if isinstance(x, jax.Array) and x.is_deleted():
        raise ValueError(
            f"argument '{path}' was donated to an earlier call (donate_argnums) and its buffer is gone: "
            "pass the value that call returned"
        )
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding, x.ndim):
        return _relabel(x, sharding)  # e.g. the Explicit view of the same layout: no data moves
    return jax.device_put(x, sharding)


def _relabel(x: jax.Array, sharding: NamedSharding) -> jax.Array:
    return jax.make_array_from_single_device_arrays(x.shape, sharding, [shard.data for shard in x.addressable_shards])


def on_mesh(outs: Sequence[Any], mesh: Mesh) -> list[Any]:
    """``outs`` (arrays with ``NamedSharding`` on a view of ``mesh``) re-labelled onto ``mesh``
    itself without moving data; unchanged when they are on ``mesh`` already.

    >>> import jax.numpy as jnp
    >>> from jax.sharding import AxisType, PartitionSpec as P
    >>> explicit = jax.make_mesh((1,), ("data",), axis_types=(AxisType.Explicit,))
    >>> auto = Mesh(explicit.devices, ("data",), axis_types=(AxisType.Auto,))
    >>> x = jax.device_put(jnp.ones(2), NamedSharding(auto, P("data")))
    >>> on_mesh([x], explicit)[0].sharding.mesh.axis_types
    (Explicit,)
    """
    out = []
    for x in outs:
        s = getattr(x, "sharding", None)
        if isinstance(s, NamedSharding) and s.mesh != mesh:
            x = _relabel(x, NamedSharding(mesh, s.spec, memory_kind=s.memory_kind))
        out.append(x)
    return out


def dispatch_key(tree: Any, leaves: Sequence[Any]) -> Any:
    """What selects a compiled program for a call: the arguments' structure, shapes and dtypes
    (None where a leaf is not an array)."""
    try:
        return tree, tuple((x.shape, x.dtype) for x in leaves)
    except AttributeError:
        return None


DIRECT_MISSES = 3  # calls in a row with an argument committed elsewhere before placing every call


def placed_call(run: Callable, shardings: Sequence[NamedSharding], paths: Sequence[str], mesh: Mesh,
                out_tree: Any, finish: Callable | None, *, direct: bool) -> Callable[[list], Any]:
    """A call of ``run`` (a compiled program for ``mesh``'s Auto view) on argument leaves: the
    outputs into ``out_tree``, then ``finish`` (None: nothing to do). ``direct``: the leaves go to
    ``run`` as they are (it moves host arrays onto the planned shardings itself, as ``jax.jit``
    does); a call with one committed elsewhere (a freshly initialised state) is placed instead,
    and after :data:`DIRECT_MISSES` such calls in a row every call is. Placed: each leaf not laid
    out as planned is moved first (a step's outputs fed back pass as they are) and the outputs go
    onto ``mesh`` itself. Not direct where arguments may be donated (a deleted buffer must be
    caught before the program runs) or ``mesh`` has Explicit axes."""
    misses = [0 if direct else DIRECT_MISSES]

    def call(leaves: list) -> Any:
        outs = None
        if misses[0] < DIRECT_MISSES:
            try:
                outs = run(*leaves)
                misses[0] = 0
            except ValueError:  # an argument committed to other shardings
                misses[0] += 1
        if outs is None:
            placed = [place(x, s, p) for x, s, p in zip(leaves, shardings, paths, strict=True)]
            with _compat.planning_mesh_context(mesh):
                outs = on_mesh(run(*placed), mesh)
        result = tree_util.tree_unflatten(out_tree, outs)
        return result if finish is None else finish(result)

    return call
