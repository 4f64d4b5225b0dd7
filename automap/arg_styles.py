"""Arguments of every style, reduced to what a partitioned program can take: pytrees of arrays.

A call's (dynamic) arguments go through two steps before planning, undone after the call:

1. **nnx objects** (``nnx.Module``, ``nnx.Optimizer``, ``nnx.Rngs``: any ``nnx.Pytree``, or a bare
   ``nnx.Variable``) are split into pure state and written back into after the call, as under
   ``nnx.jit`` (see :mod:`automap.nnx_args`). Only they are: an ``nnx.State`` (from
   ``nnx.split``), an optax state, a dict or any other pytree is an ordinary pytree argument, as
   under ``jax.jit``: never mutated, its new value returned by the function as an output.
2. **Equinox Modules' non-array leaves** (activation functions, Python ints and bools, ...) are
   static, as under ``eqx.filter_jit``. Everywhere else leaves are taken as ``jax.jit`` takes
   them (Python scalars are dynamic; a string is an error naming its path). Static leaves are
   part of the plan's cache key (a new value is a new plan) and must be hashable; outputs get the
   same split, their static leaves put back after the call.

>>> import jax, jax.numpy as jnp, equinox as eqx
>>> mlp = eqx.nn.MLP(2, 2, 4, 1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
>>> styles = ArgStyles.split((mlp, jnp.ones(3)), ())
>>> styles.pure_args[0].activation is None, styles.statics[0].activation is jax.nn.relu
(True, True)
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax import tree_util

from automap.nnx_args import GraphArgs

def _is_eqx_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")  # equinox is optional: its modules exist only if it is imported
    return eqx is not None and isinstance(x, eqx.Module)


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)) or hasattr(x, "__jax_array__")


def dynamic_mask(tree: Any) -> Any:
    """``tree`` with each leaf replaced by whether it is dynamic (see the module docstring)."""

    def mask(sub: Any) -> Any:
        return tree_util.tree_map(_is_array, sub) if _is_eqx_module(sub) else True

    return tree_util.tree_map(mask, tree, is_leaf=_is_eqx_module)


def partition(tree: Any) -> tuple[Any, Any]:
    """(the dynamic part, the static part) of ``tree``: each has ``None`` where the other has a leaf."""
    mask = dynamic_mask(tree)
    dynamic = tree_util.tree_map(lambda m, x: x if m else None, mask, tree)
    static = tree_util.tree_map(lambda m, x: None if m else x, mask, tree)
    return dynamic, static


def combine(dynamic: Any, static: Any) -> Any:
    """The inverse of :func:`partition`."""
    return tree_util.tree_map(lambda d, s: s if d is None else d, dynamic, static, is_leaf=lambda x: x is None)


def _static_key(arg_names: Sequence[str], statics: Sequence[Any]) -> Any:
    key = []
    for name, static in zip(arg_names, statics, strict=True):
        leaves, treedef = tree_util.tree_flatten_with_path(static)
        for path, leaf in leaves:
            try:
                hash(leaf)
            except TypeError:
                where = name + jax.tree_util.keystr(path)
                raise TypeError(
                    f"argument leaf '{where}' is {type(leaf).__name__} {leaf!r}, neither an array nor hashable: "
                    "automap takes non-array leaves as static (part of the plan's cache key, like eqx.filter_jit); "
                    "make it hashable (a tuple instead of a list), or an array"
                ) from None
        key.append((treedef, tuple(leaf for _, leaf in leaves)))
    return tuple(key)


@dataclasses.dataclass(frozen=True, eq=False)
class ArgStyles:
    """A call's arguments as the pure pytrees of arrays automap plans for, and how to undo that.

    ``pure_args``: the arguments with nnx objects replaced by their state and static leaves by
    ``None``; ``key``: what, besides shapes and dtypes, selects the plan (the nnx structure and
    the static leaves).
    """

    graph: GraphArgs | None
    pure_args: tuple[Any, ...]
    statics: tuple[Any, ...]  # per argument: its static part (None for static_argnums positions)
    static_argnums: tuple[int, ...]
    key: Any

    @staticmethod
    def split(args: Sequence[Any], static_argnums: Sequence[int], arg_names: Sequence[str] = ()) -> "ArgStyles":
        """Split ``args`` (positions in ``static_argnums`` are passed as they are)."""
        graph = GraphArgs.split(args, static_argnums)
        pure = list(args if graph is None else graph.pure_args)
        statics: list[Any] = [None] * len(pure)
        for i, a in enumerate(pure):
            if i not in set(static_argnums):
                pure[i], statics[i] = partition(a)
        names = [arg_names[i] if i < len(arg_names) else f"arg{i}" for i in range(len(pure))]
        key = (None if graph is None else graph.key, _static_key(names, statics))
        return ArgStyles(graph, tuple(pure), tuple(statics), tuple(static_argnums), key)

    def pure_fn(self, fn: Callable, out_static: list) -> Callable:
        """``fn`` as a function of ``pure_args`` returning only the dynamic part of its outputs
        (after ``(*new_states_of_nnx_arguments,)``); the static part goes into ``out_static[0]``."""
        inner = fn if self.graph is None else self.graph.pure_fn(fn)
        statics, static_argnums = self.statics, set(self.static_argnums)

        @functools.wraps(fn)  # keeps the signature: argument names name the paths
        def pure(*args: Any) -> Any:
            full = [a if i in static_argnums else combine(a, s) for i, (a, s) in enumerate(zip(args, statics))]
            dynamic, static = partition(inner(*full))
            out_static[:] = [static]
            return dynamic

        return pure

    def finish(self, result: Any, out_static: Any) -> Any:
        """The user's outputs from what the program returned: static leaves put back, nnx objects
        updated in place."""
        result = combine(result, out_static)
        return result if self.graph is None else self.graph.finish(result)
