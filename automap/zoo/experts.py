"""Hand-written expert PartitionSpec pytrees for zoo workloads: the baselines automap must beat.

All four functions take ``(state, batch, mesh, *, data="data", model="model")`` where `state` and
`batch` are a zoo workload's arguments (arrays or `jax.ShapeDtypeStruct`) and `mesh` is a
`jax.sharding.Mesh` (only ``mesh.shape`` is read). They return ``(state_specs, batch_specs)``:
pytrees of the same structure with `jax.sharding.PartitionSpec` leaves. A sharded leaf's spec lists
every dim (``P(None, "model")``); a fully replicated leaf is ``P()``.

The rules are name based (zoo parameter names, see `automap.zoo.gpt_linen`):

- Optimizer-state leaves (Adam ``mu``/``nu``) get their parameter's spec, matched by the trailing
  dict-key path and shape; everything else in the optimizer state (step counts) is ``P()``.
- Scanned parameters (under ``blocks``) keep their leading layers dim unsharded.
- A dim is only sharded on an axis whose size divides it; otherwise it stays replicated, so every
  zoo config gets a valid (if less sharded) plan.
- Batch leaves are sharded on dim 0 over `data` (``batch["rng"]`` stays replicated).

Megatron (tensor parallel on `model`): ``qkv`` kernel ``P(None, None, model, None)`` (by heads),
bias ``P(None, model, None)``; ``q``/``k``/``v`` kernels ``P(None, model, None)``, biases
``P(model, None)``; ``out`` kernel ``P(model, None, None)``; MLP ``up``/``gate`` ``P(None, model)``,
biases ``P(model)``; ``down`` ``P(model, None)``; ``wte`` ``P(model, None)`` (by vocab); ``head``
kernel ``P(None, model)``, bias ``P(model)``; layer norms, ``wpe`` and ``out``/``down`` biases
replicated. The zoo MLP alternates: even ``layers_i`` column-parallel, odd row-parallel.

FSDP (ZeRO-3 on `data`): each parameter's largest dim divisible by the `data` axis size (first one
on ties, never a scanned layers dim) is sharded on `data`. `fsdp_megatron` applies megatron on
`model` first and then fsdp over the dims left unsharded.

>>> import jax
>>> from automap import zoo
>>> mesh = jax.make_mesh((1, 1), ("data", "model"))
>>> w = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2))
>>> state_specs, batch_specs = zoo.experts.megatron(*w.abstract(), mesh)
>>> state_specs["params"]["blocks_0"]["mlp"]["up"]["kernel"]
P(None, 'model')
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

PyTree = Any
Dims = list  # per-dim mesh axis name or None, one entry per array dim
_M = "M"  # placeholder for the model axis in the megatron table

# Suffix of the parameter path -> spec of the unscanned parameter (the longest suffix wins).
_MEGATRON: dict[tuple[str, ...], tuple] = {
    ("attn", "qkv", "kernel"): (None, None, _M, None),
    ("attn", "qkv", "bias"): (None, _M, None),
    **{("attn", n, "kernel"): (None, _M, None) for n in "qkv"},
    **{("attn", n, "bias"): (_M, None) for n in "qkv"},
    ("attn", "out", "kernel"): (_M, None, None),
    **{("mlp", n, "kernel"): (None, _M) for n in ("up", "gate")},
    **{("mlp", n, "bias"): (_M,) for n in ("up", "gate")},
    ("mlp", "down", "kernel"): (_M, None),
    ("wte", "embedding"): (_M, None),
    ("head", "kernel"): (None, _M),
    ("head", "bias"): (_M,),
}
_MLP_LAYER = re.compile(r"layers_(\d+)")


def _names(path) -> tuple[str, ...]:
    """The trailing run of dict keys of a path (a parameter's name, also inside optimizer state)."""
    names = []
    for entry in reversed(path):
        if not isinstance(entry, jax.tree_util.DictKey):
            break
        names.append(str(entry.key))
    return tuple(reversed(names))


def _scanned(names: tuple[str, ...]) -> bool:
    return "blocks" in names


def _axis_size(mesh, axis: str | None, *, optional: bool = False) -> int | None:
    if axis is None:
        return None
    shape = dict(mesh.shape)
    if axis not in shape:
        if optional:
            return None
        raise ValueError(f"mesh axis {axis!r} not in mesh axes {tuple(shape)}; pass the axis name.")
    return shape[axis]


def _fits(spec: tuple, shape: tuple, size: int) -> tuple:
    """Drop any placeholder whose dim the axis size does not divide."""
    return tuple(None if a is not None and shape[d] % size else a for d, a in enumerate(spec))


def _megatron_dims(names, shape, model: str, size: int) -> Dims:
    lead = 1 if _scanned(names) else 0
    inner = tuple(shape[lead:])
    base = None
    match = _MLP_LAYER.fullmatch(names[-2]) if len(names) >= 2 else None
    if match and names[-1] in ("kernel", "bias"):
        even = int(match.group(1)) % 2 == 0
        base = {("kernel", True): (None, _M), ("kernel", False): (_M, None), ("bias", True): (_M,)}
        base = base.get((names[-1], even))
    else:
        for suffix in sorted(_MEGATRON, key=len, reverse=True):
            if names[-len(suffix) :] == suffix:
                base = _MEGATRON[suffix]
                break
    if base is None or len(base) != len(inner):
        return [None] * len(shape)
    base = _fits(base, inner, size)
    return [None] * lead + [model if a == _M else None for a in base]


def _fsdp_dims(names, shape, dims: Dims, data: str, size: int) -> Dims:
    lead = 1 if _scanned(names) else 0
    free = [d for d in range(lead, len(shape)) if dims[d] is None and shape[d] % size == 0]
    if free:
        best = max(free, key=lambda d: (shape[d], -d))
        dims = dims[:best] + [data] + dims[best + 1 :]
    return dims


def _spec(dims: Dims) -> P:
    return P(*dims) if any(a is not None for a in dims) else P()


def _assemble(
    state: PyTree, batch: PyTree, rule: Callable[[tuple, tuple], Dims], data: str | None, size
) -> tuple[PyTree, PyTree]:
    flat, _ = jax.tree_util.tree_flatten_with_path(state["params"])
    table = {}
    for path, leaf in flat:
        names = _names(path)
        table[names] = (tuple(leaf.shape), _spec(rule(names, tuple(leaf.shape))))

    def state_spec(path, leaf):
        names = _names(path)
        if path and path[0] == jax.tree_util.DictKey("params"):
            names = names[1:]  # a parameter itself; optimizer moments have no "params" prefix
        entry = table.get(names)
        return entry[1] if entry is not None and entry[0] == tuple(leaf.shape) else P()

    def batch_spec(path, leaf):
        shape = tuple(leaf.shape)
        names = _names(path)
        if data is None or not shape or (names and names[-1] == "rng") or shape[0] % size:
            return P()
        return P(data, *([None] * (len(shape) - 1)))

    return (
        jax.tree_util.tree_map_with_path(state_spec, state),
        jax.tree_util.tree_map_with_path(batch_spec, batch),
    )


def data_parallel(state, batch, mesh, *, data: str = "data", model: str = "model"):
    """Pure data parallelism: every state leaf replicated, batch dim 0 on `data` (`model` unused).

    >>> import jax, jax.numpy as jnp
    >>> mesh = jax.make_mesh((1,), ("data",))
    >>> state = {"params": {"w": jnp.zeros((4, 4))}, "opt_state": ()}
    >>> data_parallel(state, {"x": jnp.zeros((8, 4))}, mesh)[1]
    {'x': P('data', None)}
    """
    size = _axis_size(mesh, data)
    return _assemble(state, batch, lambda names, shape: [None] * len(shape), data, size)


def megatron(state, batch, mesh, *, data: str | None = "data", model: str = "model"):
    """Megatron tensor parallelism on `model` (table in the module docstring), batch on `data`.

    `data=None`, or a `data` name the mesh does not have, leaves the batch replicated.

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.mlp(zoo.MLPConfig(d_in=4, hidden=(8,), d_out=2, batch=2))
    >>> specs, _ = megatron(*w.abstract(), jax.make_mesh((1,), ("model",)))
    >>> specs["params"]["layers_0"]["kernel"], specs["params"]["layers_1"]["kernel"]
    (P(None, 'model'), P('model', None))
    """
    msize = _axis_size(mesh, model)
    dsize = _axis_size(mesh, data, optional=True)

    def rule(names, shape):
        return _megatron_dims(names, shape, model, msize)

    return _assemble(state, batch, rule, data if dsize else None, dsize)


def fsdp(state, batch, mesh, *, data: str = "data", model: str = "model"):
    """FSDP / ZeRO-3 on `data`: each parameter and its Adam moments sharded on the largest dim.

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.mlp(zoo.MLPConfig(d_in=4, hidden=(8,), d_out=2, batch=2))
    >>> specs, batch_specs = fsdp(*w.abstract(), jax.make_mesh((1,), ("data",)))
    >>> specs["params"]["layers_0"]["kernel"], batch_specs["x"]
    (P(None, 'data'), P('data', None))
    """
    size = _axis_size(mesh, data)

    def rule(names, shape):
        return _fsdp_dims(names, shape, [None] * len(shape), data, size)

    return _assemble(state, batch, rule, data, size)


def fsdp_megatron(state, batch, mesh, *, data: str = "data", model: str = "model"):
    """Megatron on `model`, then FSDP on `data` over the dims left; batch on `data`.

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2))
    >>> mesh = jax.make_mesh((1, 1), ("data", "model"))
    >>> specs, _ = fsdp_megatron(*w.abstract(), mesh)
    >>> specs["params"]["blocks_0"]["mlp"]["up"]["kernel"]
    P('data', 'model')
    """
    dsize, msize = _axis_size(mesh, data), _axis_size(mesh, model)

    def rule(names, shape):
        return _fsdp_dims(names, shape, _megatron_dims(names, shape, model, msize), data, dsize)

    return _assemble(state, batch, rule, data, dsize)
