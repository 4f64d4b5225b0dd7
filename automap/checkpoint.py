"""Checkpoints of sharded train state (orbax), restored straight onto a plan's shardings.

``save(path, state, plan=None)`` writes a pytree of arrays (flax nnx objects are saved as their
``nnx.to_pure_dict`` state) to the directory ``path`` with orbax's synchronous
``StandardCheckpointHandler``; every device writes its own shards. ``restore(path, target)`` reads
it back onto ``target``: a :class:`~automap.plan.Plan` (the argument the checkpoint is for is found by
its leaf paths), a pytree of shardings or ``jax.ShapeDtypeStruct`` with shardings, or one sharding
for every leaf. Each device reads only its own slices, so restoring onto another mesh is a matter of
replanning on it and restoring with the new plan.

Leaves are matched by path (``a/b/0/c``, as ``plan.report()`` prints them without the argument
name): a checkpoint of ``state`` (the ``train_step(state, batch)`` argument) has paths like
``params/...`` and restores onto the plan's ``state`` argument; a checkpoint of
``{"model": model, "optimizer": optimizer}`` has paths like ``model/...``, ``optimizer/...`` and
restores onto the plan's ``model`` and ``optimizer`` arguments together (as such a dict; write it
back with ``nnx.update(model, restored["model"])``).

>>> import os, tempfile, jax.numpy as jnp, automap, tactics
>>> from jax.sharding import PartitionSpec as P
>>> def train_step(state, x):
...     return {"w": state["w"] - 0.1 * x.T @ (x @ state["w"])}, (x @ state["w"]).sum()
>>> state, x = {"w": jnp.ones((4, 4))}, jnp.ones((8, 4))
>>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
>>> save(path, state)
>>> mesh = automap.make_mesh({"data": 2, "model": 4})
>>> step = automap.partition(train_step, mesh=mesh, tactics=[tactics.manual({"w": P(None, "model")})])
>>> restore(path, step.plan(state, x))["w"].sharding.spec
P(None, 'model')
"""
from __future__ import annotations

import os
from typing import Any, Mapping

import jax
from jax import tree_util

from automap.plan import Plan
from automap.atomic import readable_directory, replace_directory, staging_directory
from automap.nnx_args import GraphArgs
from automap.trace import path_str

__all__ = ["restore", "save", "target_for"]


def _orbax() -> Any:
    try:
        import orbax.checkpoint as ocp
    except ImportError as e:
        raise ImportError(
            f"automap.checkpoint needs orbax-checkpoint ({e}): install it with pip install 'automap[checkpoint]' "
            "(or pip install orbax-checkpoint)"
        ) from None
    return ocp


def _checkpointer() -> Any:
    ocp = _orbax()
    return ocp.Checkpointer(ocp.StandardCheckpointHandler())  # synchronous: returns when written


def _pure(state: Any) -> Any:
    """Arrays by path: nnx objects and an ``nnx.State`` as their pure dicts (``l1/kernel``)."""
    from flax import nnx

    if isinstance(state, nnx.State):
        return nnx.to_pure_dict(state)
    split = GraphArgs.split((state,), ())
    return state if split is None else split.pure_args[0]


def _flat(tree: Any) -> dict[str, Any]:
    return {path_str("", p): leaf for p, leaf in tree_util.tree_flatten_with_path(tree)[0]}


def _shape_dtype(leaf: Any) -> tuple[tuple[int, ...], str]:
    return tuple(leaf.shape), str(leaf.dtype)


def target_for(plan: Any, leaves: Mapping[str, Any], *, arg: int | str | None = None) -> Any:
    """The abstract pytree (``ShapeDtypeStruct`` with the plan's shardings) of the plan argument(s)
    whose leaf paths are those of ``leaves`` (path -> array or metadata with shape and dtype).

    >>> import jax.numpy as jnp, automap
    >>> plan = automap.partition(lambda p, x: x @ p["w"], mesh=automap.make_mesh({"data": 2})).plan(
    ...     {"w": jnp.ones((4, 2))}, jnp.ones((8, 4)))
    >>> target_for(plan, {"w": jnp.ones((4, 2))})["w"].shape
    (4, 2)
    """
    names = plan.traced.arg_names
    shardings = plan.in_shardings
    avals = tree_util.tree_unflatten(plan.traced.in_tree, list(plan.traced.in_avals))
    args = [tree_util.tree_map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), avals[i], shardings[i])
            for i in range(len(names))]
    if arg is not None:
        if isinstance(arg, str) and arg not in names:
            raise ValueError(f"arg={arg!r} is not an argument of the plan; its arguments are {list(names)}")
        candidates = [names.index(arg) if isinstance(arg, str) else int(arg)]
    else:
        candidates = list(range(len(names)))
    want = set(leaves)
    found = [(names[i], args[i]) for i in candidates if set(_flat(args[i])) == want]
    tops = {p.split("/", 1)[0] for p in want}
    if arg is None and tops <= set(names):  # a dict of several arguments, by name
        together = {n: args[names.index(n)] for n in names if n in tops}
        if set(_flat(together)) == want:
            found.append((" + ".join(together), together))
    if not found:
        raise ValueError(_no_match(names, args, candidates, want))
    if len(found) > 1:
        raise ValueError(
            f"the checkpoint's leaves match several arguments of the plan ({', '.join(n for n, _ in found)}); "
            "pass arg=<name or index> to say which one it is"
        )
    target = found[0][1]
    bad = [f"'{p}' is {_fmt(leaves[p])} in the checkpoint, {_fmt(t)} in the plan"
           for p, t in sorted(_flat(target).items()) if _shape_dtype(t) != _shape_dtype(leaves[p])]
    if bad:
        raise ValueError(
            f"{len(bad)} leaves differ between the checkpoint and the plan's '{found[0][0]}': {'; '.join(bad[:4])}"
            f"{f' (and {len(bad) - 4} more)' if len(bad) > 4 else ''}. Restore onto a plan made for the same model "
            "sizes and dtypes"
        )
    return target


def _fmt(leaf: Any) -> str:
    shape, dtype = _shape_dtype(leaf)
    return f"{dtype}{list(shape)}"


def _no_match(names: Any, args: list, candidates: list[int], want: set[str]) -> str:
    def score(i: int) -> int:
        return len(set(_flat(args[i])) & want)

    best = max(candidates, key=score)
    have = set(_flat(args[best]))
    missing, extra = sorted(want - have)[:5], sorted(have - want)[:5]
    return (
        f"no argument of the plan ({', '.join(names)}) has the checkpoint's leaf paths; the closest, "
        f"'{names[best]}', lacks {missing} and has {extra} that the checkpoint lacks (first 5 each). Save the "
        "argument itself (save(path, state)) or a dict of arguments by name ({'model': model, ...}), and restore "
        "with a plan of the same function; or pass arg=, or a pytree of shardings"
    )


def save(path: str | os.PathLike, state: Any, plan: Any = None, *, arg: int | str | None = None,
         force: bool = False) -> None:
    """Write ``state`` to the directory ``path`` (see the module docstring).

    With ``plan``, ``state`` must be (by its leaf paths) an argument of the plan, or a dict of
    arguments by name: arrays not yet placed are put on the plan's shardings first, and the plan's
    fingerprint and mesh are recorded in the checkpoint's metadata. ``force`` replaces an existing
    checkpoint atomically: the new one is written beside it and swapped in when complete, so a
    process killed at any moment leaves the old or the new checkpoint (:mod:`automap.atomic`).

    >>> import os, tempfile, jax.numpy as jnp
    >>> save(os.path.join(tempfile.mkdtemp(), "ckpt"), {"w": jnp.ones(4)})
    """
    state = _pure(state)
    meta: dict[str, Any] = {}
    if plan is not None:
        target = _flat(target_for(plan, _flat(state), arg=arg))
        flat, tree = tree_util.tree_flatten_with_path(state)
        placed = [x if isinstance(x, jax.Array) else jax.device_put(x, target[path_str("", p)].sharding)
                  for p, x in flat]
        state = tree_util.tree_unflatten(tree, placed)
        mesh = {str(a): int(n) for a, n in plan.mesh.shape.items()}
        meta = {"automap": {"fingerprint": plan.fingerprint, "mesh": mesh}}
    ocp = _orbax()

    path = os.path.abspath(path)
    if os.path.exists(path) and not force:
        raise FileExistsError(f"checkpoint {path} exists already: pass force=True to replace it (the old one "
                              "stays readable until the new one is complete), or save to another path")
    primary = ocp.multihost.is_primary_host(0)
    new = staging_directory(path) if primary else path + ".new"
    ocp.multihost.sync_global_processes("automap_checkpoint_staging")
    _checkpointer().save(new, args=ocp.args.StandardSave(state), custom_metadata=meta)
    if primary:  # written completely: swap it in (a crash leaves the old or the new checkpoint)
        replace_directory(new, path)
    ocp.multihost.sync_global_processes("automap_checkpoint_replaced")


def restore(path: str | os.PathLike, target: Any, *, arg: int | str | None = None) -> Any:
    """Read the checkpoint at ``path`` onto ``target``'s shardings (see the module docstring).

    ``target``: a Plan (``arg`` picks the argument when the paths alone do not), a pytree of
    ``jax.sharding.Sharding`` or ``jax.ShapeDtypeStruct`` (with ``sharding=``) matching the saved
    state, or a single ``Sharding`` for every leaf. Returns the state with the target's structure.

    >>> import os, tempfile, jax, jax.numpy as jnp, automap
    >>> path = os.path.join(tempfile.mkdtemp(), "ckpt")
    >>> save(path, {"w": jnp.arange(8.0)})
    >>> sharding = jax.sharding.NamedSharding(automap.make_mesh({"data": 2}), jax.sharding.PartitionSpec("data"))
    >>> restore(path, {"w": sharding})["w"].sharding == sharding
    True
    """
    ocp = _orbax()

    path = readable_directory(path)
    ckptr = _checkpointer()
    stored_tree = ckptr.metadata(path).item_metadata
    stored_tree = getattr(stored_tree, "tree", stored_tree)
    stored = _flat(stored_tree)
    if isinstance(target, jax.sharding.Sharding):
        abstract = tree_util.tree_map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=target), stored_tree)
    elif isinstance(target, Plan):
        abstract = target_for(target, stored, arg=arg)
    else:
        is_leaf = lambda x: isinstance(x, (jax.sharding.Sharding, jax.ShapeDtypeStruct))  # noqa: E731
        abstract = tree_util.tree_map_with_path(lambda p, s: _abstract(path_str("", p), s, stored), target, is_leaf=is_leaf)
    return ckptr.restore(path, args=ocp.args.StandardRestore(abstract))


def _abstract(path: str, leaf: Any, stored: Mapping[str, Any]) -> jax.ShapeDtypeStruct:
    if path not in stored:
        raise ValueError(f"the target has leaf '{path}' but the checkpoint does not (it has {sorted(stored)[:8]}...); "
                         "pass shardings with the saved state's structure")
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf
    m = stored[path]
    return jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=leaf)
