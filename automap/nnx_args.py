"""flax nnx objects as arguments: split them into pure state, plan a pure function, write back.

Only arguments holding nnx objects (``nnx.Pytree`` instances: Module, Optimizer, Rngs, ...; or a
bare ``nnx.Variable``) are taken: an ``nnx.State`` or optax state is an ordinary pytree, as
under ``jax.jit`` (see :mod:`automap.arg_styles`).

A function such as ``train_step(model, optimizer, batch)`` that calls ``model(x)`` and
``optimizer.update(model, grads)`` mutates its arguments, which a partitioned program cannot do.
As ``nnx.jit`` does, the nnx graph nodes among the (dynamic) arguments are split together
(``nnx.split``, so objects shared between arguments stay shared) into a graphdef and their state;
automap plans and runs a *pure* function of the states: it merges them into fresh objects, runs
the user's function, splits them again and returns ``(*new_states, outputs)``. After the call the
caller's objects are updated in place (``nnx.update``) with the new, sharded, state, so the next
call finds its arrays already on the plan's shardings and moves nothing.

Path naming: an nnx argument's state is its ``nnx.to_pure_dict`` nested dict, so its leaves are
named ``<argument name>/<attribute path>`` without the ``Variable`` wrapper, e.g.
``model/l1/kernel``, ``model/layers/0/bias`` (list index), ``optimizer/step``,
``optimizer/opt_state/0/mu/l1/kernel`` (optax state: tuple index, then field). These are the paths
``tactics.manual`` rules match, ``plan.report()`` prints and plan files store. The plan's
``in_shardings`` has these pure dicts in place of the objects; its ``out_shardings`` is
``(*new_state_of_each_nnx_argument, outputs)``.

Plans are cached per structure (the graphdef), as under ``nnx.jit``: new objects of the same
classes and sizes reuse the plan, but a new optax transformation (``optax.adamw(...)`` called again)
is a new structure and is planned again; build the optimizer's transformation once.

>>> import jax, jax.numpy as jnp
>>> from flax import nnx
>>> model = nnx.Linear(4, 2, rngs=nnx.Rngs(0))
>>> split = GraphArgs.split((model, jnp.ones((8, 4))), ())
>>> split.indices, sorted(split.pure_args[0])
((0,), ['bias', 'kernel'])
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
from flax import nnx
from flax.nnx import graph as nnx_graph


def _is_nnx_object(x: Any) -> bool:
    return isinstance(x, nnx.Pytree) and nnx_graph.is_graph_node(x)


def _contains_nnx_object(x: Any) -> bool:
    """Whether ``x`` is an nnx object to write back into: it holds an ``nnx.Pytree`` (Module,
    Optimizer, Rngs, ...) or is a bare ``nnx.Variable``. Variables inside an ``nnx.State``, an optax
    state or a dict are values of an ordinary pytree argument, as under ``jax.jit``."""
    if isinstance(x, nnx.Variable):
        return True
    leaves = jax.tree_util.tree_leaves(x, is_leaf=_is_nnx_object)
    return any(_is_nnx_object(leaf) for leaf in leaves)


def _abstract(x: Any) -> Any:
    return jax.ShapeDtypeStruct(x.shape, x.dtype) if hasattr(x, "shape") and hasattr(x, "dtype") else x


@dataclasses.dataclass(frozen=True, eq=False)
class GraphArgs:
    """The nnx graph nodes among a call's arguments, split into a graphdef and pure state.

    ``indices``: the positions of the arguments that hold nnx objects; ``pure_args``: the
    arguments with each of those replaced by its state as a nested dict of arrays; ``key``: a
    hashable identity of the objects' structure (a new structure is a new plan).
    """

    args: tuple[Any, ...]
    indices: tuple[int, ...]
    graphdef: Any
    template: Any  # the split State with ShapeDtypeStruct leaves (no arrays kept alive)
    pure_args: tuple[Any, ...]

    @staticmethod
    def split(args: Sequence[Any], static_argnums: Sequence[int]) -> "GraphArgs | None":
        """Split the nnx objects among ``args``; ``None`` when there are none."""
        static = set(static_argnums)
        indices = tuple(i for i, a in enumerate(args) if i not in static and _contains_nnx_object(a))
        if not indices:
            return None
        graphdef, state = nnx.split(tuple(args[i] for i in indices))
        pure = nnx.to_pure_dict(state)
        pure_args = list(args)
        for k, i in enumerate(indices):
            pure_args[i] = pure.get(k, {})
        template = jax.tree_util.tree_map(_abstract, state)
        return GraphArgs(tuple(args), indices, graphdef, template, tuple(pure_args))

    @property
    def key(self) -> Any:
        return (self.indices, self.graphdef)

    def pure_fn(self, fn: Callable) -> Callable:
        """``fn`` as a pure function of ``pure_args``, returning ``(*new_states, outputs)``."""
        indices, graphdef, template = self.indices, self.graphdef, self.template

        @functools.wraps(fn)  # keeps the signature: argument names name the paths
        def pure(*args: Any) -> Any:
            state = jax.tree_util.tree_map(lambda x: x, template)  # fresh Variables
            nnx.replace_by_pure_dict(state, {k: args[i] for k, i in enumerate(indices)})
            objects = nnx.merge(graphdef, state)
            full = list(args)
            for k, i in enumerate(indices):
                full[i] = objects[k]
            out = fn(*full)
            new_graphdef, new_state = nnx.split(objects)
            if new_graphdef != graphdef:
                raise ValueError(
                    f"{getattr(fn, '__name__', 'the function')} changed the structure of its nnx arguments "
                    "(added, removed or retyped attributes or Variables); automap can only write back new values "
                    "for the same Variables: create every Variable before the call (e.g. in __init__)"
                )
            new_pure = nnx.to_pure_dict(new_state)
            return (*(new_pure.get(k, {}) for k in range(len(indices))), out)

        return pure

    def finish(self, result: Any) -> Any:
        """Write the new states in ``result`` back into the caller's objects; the user's outputs."""
        *states, out = result
        objects = tuple(self.args[i] for i in self.indices)
        nnx.update(objects, {k: s for k, s in enumerate(states)})
        return out
