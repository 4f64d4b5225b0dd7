"""Abstract tracing: a function and example arguments (arrays or ShapeDtypeStructs) to a
ClosedJaxpr, with a readable pytree path for every input and output leaf. Nothing runs and no
device memory is allocated."""
from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any, Callable, Sequence

import jax
from jax import tree_util


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    closed_jaxpr: Any
    in_tree: Any  # treedef of the dynamic args tuple
    out_tree: Any
    in_paths: tuple[str, ...]
    out_paths: tuple[str, ...]
    in_avals: tuple[jax.ShapeDtypeStruct, ...]
    out_avals: tuple[jax.ShapeDtypeStruct, ...]
    arg_names: tuple[str, ...]  # one per dynamic argument
    leaf_arg: tuple[int, ...]  # for each input leaf, the index of its dynamic argument


def _key_str(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def path_str(prefix: str, path: Sequence[Any]) -> str:
    return "/".join([prefix] + [_key_str(k) for k in path]) if prefix else "/".join(_key_str(k) for k in path)


def _is_nnx_variable(x: Any) -> bool:
    nnx = sys.modules.get("flax.nnx")  # flax is optional: its Variables exist only if it is imported
    return nnx is not None and isinstance(x, nnx.Variable)


def leaf_paths(tree: Any) -> list[tuple[Any, ...]]:
    """The key path of every leaf of ``tree``, an ``nnx.Variable``'s own ``.value`` key left out
    (``params/l1/kernel``, as for nnx objects, see :mod:`automap.nnx_args`)."""
    out = []
    for path, leaf in tree_util.tree_flatten_with_path(tree, is_leaf=_is_nnx_variable)[0]:
        if _is_nnx_variable(leaf):
            out.extend(path + inner[1:] for inner, _ in tree_util.tree_flatten_with_path(leaf)[0])
        else:
            out.append(path)
    return out


def arg_names(fn: Callable, n: int, static_argnums: Sequence[int]) -> list[str]:
    try:
        params = [
            p.name for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        params = []
    names = []
    for i in range(n):
        names.append(params[i] if i < len(params) else f"arg{i}")
    return [name for i, name in enumerate(names) if i not in set(static_argnums)]


def abstractify(x: Any) -> jax.ShapeDtypeStruct:
    if isinstance(x, jax.ShapeDtypeStruct):
        return x
    shape, dtype = getattr(x, "shape", None), getattr(x, "dtype", None)
    if shape is None or dtype is None:
        x = jax.numpy.asarray(x)
        shape, dtype = x.shape, x.dtype
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


_CONCRETE_VALUE_ERRORS = (
    jax.errors.ConcretizationTypeError, jax.errors.TracerIntegerConversionError, jax.errors.TracerArrayConversionError,
)


def trace(fn: Callable, args: Sequence[Any], *, static_argnums: Sequence[int] = ()) -> Traced:
    """Trace ``fn(*args)`` abstractly.

    >>> import jax, jax.numpy as jnp
    >>> t = trace(lambda params, x: x @ params["w"], ({"w": jnp.ones((4, 2))}, jax.ShapeDtypeStruct((8, 4), jnp.float32)))
    >>> t.in_paths
    ('params/w', 'x')
    """
    static = set(static_argnums)
    dynamic = [a for i, a in enumerate(args) if i not in static]
    names = arg_names(fn, len(args), static_argnums)
    abstract = tree_util.tree_map(abstractify, dynamic)

    def flat_fn(*dyn: Any) -> Any:
        it = iter(dyn)
        full = [args[i] if i in static else next(it) for i in range(len(args))]
        return fn(*full)

    try:
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*abstract)
    except _CONCRETE_VALUE_ERRORS as e:  # Python control flow / NumPy on a traced value
        name = getattr(fn, "__name__", "the function")
        e.add_note(
            f"automap traces {name} with abstract arguments (like jax.jit), so Python `if`/`while`, int() "
            "and NumPy cannot look at array values: use jax.lax.cond / jnp.where / jax.lax.while_loop / "
            "jax.lax.fori_loop and jax.numpy, or pass the value as a static argument (static_argnums=...)"
        )
        raise
    in_leaves, in_tree = tree_util.tree_flatten(tuple(abstract))
    in_paths, leaf_arg = [], []
    for path in leaf_paths(tuple(dynamic)):
        i = path[0].idx
        in_paths.append(path_str(names[i], path[1:]))
        leaf_arg.append(i)
    out_leaves, out_tree = tree_util.tree_flatten(out_shape)
    if isinstance(out_shape, tuple):
        out_paths = [path_str("out", p) for p in leaf_paths(out_shape)]
    else:
        out_paths = [path_str("out", p) if p else "out" for p in leaf_paths(out_shape)]
    return Traced(
        closed, in_tree, out_tree, tuple(in_paths), tuple(out_paths), tuple(in_leaves), tuple(out_leaves),
        tuple(names), tuple(leaf_arg),
    )


def feedback_pairs(traced: Traced) -> dict[int, int]:
    """Output leaf index -> input leaf index for outputs that return an argument's updated value.

    A *state* argument has the same pytree structure, shapes and dtypes as (a part of) the
    output. To avoid mistaking a shape-preserving function (``lambda x: x.T``) for an update,
    a bare array is only paired when it comes back at its own position in a tuple of outputs
    (``step(w, x) -> (w, loss)``); a container (dict, list, tuple, dataclass) is paired wherever
    its structure comes back (``step(state, batch) -> (metrics, state)``).
    """
    out = tree_util.tree_unflatten(traced.out_tree, list(range(len(traced.out_avals))))
    ins = tree_util.tree_unflatten(traced.in_tree, list(range(len(traced.in_avals))))
    pairs: dict[int, int] = {}

    def same(part: Any, arg: Any) -> bool:
        out_leaves, out_def = tree_util.tree_flatten(part)
        in_leaves, in_def = tree_util.tree_flatten(arg)
        if in_def != out_def or not in_leaves:
            return False
        return all(
            traced.out_avals[o].shape == traced.in_avals[i].shape
            and traced.out_avals[o].dtype == traced.in_avals[i].dtype
            for o, i in zip(out_leaves, in_leaves, strict=True)
        )

    def pair(part: Any, arg: Any) -> None:
        pairs.update(zip(tree_util.tree_leaves(part), tree_util.tree_leaves(arg), strict=True))

    multi = [arg for arg in ins if not tree_util.treedef_is_leaf(tree_util.tree_structure(arg))]
    # the whole output first (``state -> state`` with a pytree state), else each part
    whole = next((arg for arg in multi if same(out, arg)), None)
    if whole is not None:
        pair(out, whole)
    elif isinstance(out, (tuple, list)):
        for pos, part in enumerate(out):
            arg = next((a for a in multi if same(part, a)), None)
            if arg is None and pos < len(ins) and same(part, ins[pos]):
                arg = ins[pos]
            if arg is not None:
                pair(part, arg)
    return pairs
