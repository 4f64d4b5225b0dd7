"""Presets: the common parallelism recipes as compositions of tactics (no new code paths).

Each preset is a :class:`~tactics.base.Schedule`: the tactics run in order and the earlier ones
decide first, so the batch is split before the weights are (the activations keep the batch layout
and the weights are gathered or all-reduced around them).

>>> import tactics
>>> [t.name for t in tactics.fsdp_tp().tactics]
['data_parallel', 'megatron', 'fsdp']
"""
from __future__ import annotations

from tactics.base import Schedule, schedule
from tactics.data_parallel import data_parallel
from tactics.fsdp import Stage, fsdp, zero
from tactics.megatron import megatron


def megatron_dp(data: str = "data", model: str = "model") -> Schedule:
    """Megatron tensor parallelism on ``model`` with data parallelism on ``data``:
    ``schedule(data_parallel(data), megatron(model))``.

    >>> import jax, jax.numpy as jnp, automap
    >>> def loss(w, x):
    ...     return (jnp.tanh(x @ w["up"]) @ w["down"]).sum()
    >>> def step(w, x):
    ...     value, g = jax.value_and_grad(loss)(w, x)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, w, g), value
    >>> mesh = automap.make_mesh({"data": 2, "model": 4})
    >>> w = {"up": jnp.ones((8, 16)), "down": jnp.ones((16, 8))}
    >>> plan = automap.partition(step, mesh=mesh, tactics=[megatron_dp()]).plan(w, jnp.ones((4, 8)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]  # down, up, x
    [(('model',), ()), ((), ('model',)), (('data',), ())]
    """
    return schedule(data_parallel(data), megatron(model))


def fsdp_tp(data: str = "data", model: str = "model") -> Schedule:
    """FSDP on ``data`` combined with Megatron tensor parallelism on ``model``:
    ``schedule(data_parallel(data), megatron(model), fsdp(data))``. Each weight is split on
    ``model`` where Megatron splits it and on ``data`` along its largest dim left.

    >>> import jax, jax.numpy as jnp, automap
    >>> def loss(w, x):
    ...     return (jnp.tanh(x @ w["up"]) @ w["down"]).sum()
    >>> def step(w, x):
    ...     value, g = jax.value_and_grad(loss)(w, x)
    ...     return jax.tree.map(lambda p, g: p - 0.1 * g, w, g), value
    >>> mesh = automap.make_mesh({"data": 2, "model": 4})
    >>> w = {"up": jnp.ones((8, 16)), "down": jnp.ones((16, 8))}
    >>> plan = automap.partition(step, mesh=mesh, tactics=[fsdp_tp()]).plan(w, jnp.ones((4, 8)))
    >>> [plan.state.spec(v) for v in plan.program.inputs]  # down, up, x
    [(('model',), ('data',)), (('data',), ('model',)), (('data',), ())]
    """
    return schedule(data_parallel(data), megatron(model), fsdp(data))


def zero_dp(stage: Stage, data: str = "data") -> Schedule:
    """ZeRO stage ``stage`` (1: optimizer state, 2: + gradients, 3: + parameters sharded) with
    data parallelism on ``data``: ``schedule(data_parallel(data), zero(stage, data))``.

    >>> [t.name for t in zero_dp(2).tactics], zero_dp(2).tactics[1].stage
    (['data_parallel', 'zero'], 2)
    """
    return schedule(data_parallel(data), zero(stage, data))


def fsdp_only(data: str = "data") -> Schedule:
    """Pure FSDP (ZeRO-3) on ``data``, the batch split on the same axis:
    ``schedule(data_parallel(data), fsdp(data))``.

    >>> [t.name for t in fsdp_only("batch").tactics]
    ['data_parallel', 'fsdp']
    """
    return schedule(data_parallel(data), fsdp(data))
