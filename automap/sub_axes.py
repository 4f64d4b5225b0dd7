"""Shardy's sub-axes, for :mod:`automap.xla_layout`: a mesh axis split into the pieces a dim takes.

Where a dim's axes meet a factor that one of them does not fit whole, Shardy takes the largest
prefix of that axis the factor has room for (a *sub-axis*, ``"model":(1)2``: the first 2 of
'model''s 4) and gives the rest (``"model":(2)2``) to the next factor: a reshape of a dim of 32
over ('data', 'model') (2x4) into heads x head_dim (4x8) splits the heads over ('data',
"model":(1)2) and head_dim over "model":(2)2, and the attention's dots run on an eighth of the
heads x head_dim each, not on a half (equinox's ``MultiheadAttention`` under FSDP; measured with
``XLA_FLAGS=--xla_dump_to`` in Shardy's ``02.after_propagation.mlir``). automap's layouts hold
whole axes only: :func:`refined` lays a state out on a mesh whose axes are split into their prime
sub-axes, major first (``model`` of 4 -> ``model:(1)2``, ``model:(2)2``: the same devices in the
same order), on which a sub-axis is an axis; :func:`coarsened` gives the whole axes back where
every value holds an axis's sub-axes all together, in order, or none of them, so only a layout
that splits an axis apart keeps the refined mesh. An axis whose size is not a prime power is kept
whole (its sub-axes would fix one order of its prime factors; Shardy takes whichever prefix fits).

A convolution's output spatial dims take sub-axes where its windows tile its input
(:func:`automap.rules.conv_windows.tiled_spatial_dims`): linen_vit's patch embedding under
``schedule(fsdp('data'), fsdp('model'))`` has its patch grid 2x2 over "model":(1)2 x "model":(2)2
from the sequence's reshape, and runs on a quarter of the patches as XLA runs it (6,144 FLOPs per
device; 24,576 while its spatial dims had no factors); its kernel gradient (24,576) matches XLA's.
Overlapping windows (a 3x3 conv's) keep their spatial dims whole.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from automap.shardings import ShardingState

Spec = tuple[tuple[str, ...], ...]

__all__ = ["coarsened", "on_whole_axes", "refined", "sub_axes", "whole_axis"]


def _prime_power(n: int) -> tuple[int, int] | None:
    """(p, k) with n == p**k, k >= 2; None otherwise."""
    for p in range(2, n + 1):
        if n % p == 0:
            k = 0
            while n % p == 0:
                n, k = n // p, k + 1
            return (p, k) if n == 1 and k >= 2 else None
    return None


def sub_axes(axes: Mapping[str, int]) -> dict[str, tuple[tuple[str, int], ...]]:
    """Axis -> its sub-axes (name, size), major first, for the axes of prime-power size.

    >>> sub_axes({"data": 2, "model": 4})
    {'model': (('model:(1)2', 2), ('model:(2)2', 2))}
    """
    out = {}
    for a, n in axes.items():
        got = _prime_power(n)
        if got is not None:
            p, k = got
            out[a] = tuple((f"{a}:({p ** i}){p}", p) for i in range(k))
    return out


def whole_axis(name: str) -> str:
    """The mesh axis a (sub-)axis name belongs to.

    >>> whole_axis("model:(2)2"), whole_axis("data")
    ('model', 'data')
    """
    return name.split(":(", 1)[0]


def refined(state: ShardingState, specs: Mapping[int, Spec]) -> tuple[dict[str, int], dict[int, Spec]]:
    """The mesh of ``state``'s axes split into their sub-axes (:func:`sub_axes`), and ``specs`` on it.

    >>> from types import SimpleNamespace
    >>> refined(SimpleNamespace(axes={"data": 2, "model": 4}), {7: (("data", "model"), ())})
    ({'data': 2, 'model:(1)2': 2, 'model:(2)2': 2}, {7: (('data', 'model:(1)2', 'model:(2)2'), ())})
    """
    subs = sub_axes(state.axes)
    parts = {a: tuple(name for name, _ in pieces) for a, pieces in subs.items()}
    sizes: dict[str, int] = {}
    for a, n in state.axes.items():
        sizes.update(dict(subs[a]) if a in parts else {a: n})
    return sizes, {v: tuple(tuple(s for a in axes for s in parts.get(a, (a,))) for axes in spec)
                   for v, spec in specs.items()}


def coarsened(state: ShardingState, specs: Mapping[int, Spec]) -> tuple[dict[str, int], dict[int, Spec]] | None:
    """``specs`` (on :func:`refined`'s mesh) back on ``state``'s own mesh, or None where a dim
    holds part of an axis (some of its sub-axes, or not in order).

    >>> from types import SimpleNamespace
    >>> mesh = SimpleNamespace(axes={"data": 2, "model": 4})
    >>> coarsened(mesh, {7: (("data", "model:(1)2", "model:(2)2"), ())})
    ({'data': 2, 'model': 4}, {7: (('data', 'model'), ())})
    >>> coarsened(mesh, {7: (("data", "model:(1)2"), ("model:(2)2",))}) is None
    True
    """
    parts = _parts(state.axes)
    out = {}
    for v, spec in specs.items():
        dims = [_whole_dim(axes, parts) for axes in spec]
        if not all(complete for _, complete in dims):
            return None
        out[v] = tuple(whole for whole, _ in dims)
    return dict(state.axes), out


def on_whole_axes(spec: Spec, sizes: Mapping[str, int]) -> Spec:
    """``spec`` on the whole mesh axes ``sizes``: each run of an axis's sub-axes (all of them,
    major first) given back as the axis, a part of an axis dropped (as :func:`coarsened`, which
    gives up there instead; a ``NamedSharding`` names whole axes).

    >>> on_whole_axes((("data", "model:(1)2", "model:(2)2"), ("model:(1)2",), ()), {"data": 2, "model": 4})
    (('data', 'model'), (), ())
    """
    parts = _parts(sizes)
    return tuple(_whole_dim(axes, parts)[0] for axes in spec)


def _parts(sizes: Mapping[str, int]) -> dict[str, tuple[str, ...]]:
    """Axis -> the names of its sub-axes, major first (axes :func:`sub_axes` splits)."""
    return {a: tuple(name for name, _ in subs) for a, subs in sub_axes(sizes).items()}


def _whole_dim(axes: tuple[str, ...], parts: Mapping[str, tuple[str, ...]]) -> tuple[tuple[str, ...], bool]:
    """(the whole axes of one dim's ``axes``: each axis, or all its sub-axes in order; whether
    nothing was left out: a part of an axis is skipped)."""
    whole: list[str] = []
    complete, i = True, 0
    while i < len(axes):
        axis = whole_axis(axes[i])
        names = (axis,) if axes[i] == axis else parts.get(axis, (axis,))
        if tuple(axes[i:i + len(names)]) == names:
            whole.append(axis)
            i += len(names)
        else:
            complete, i = False, i + 1
    return tuple(whole), complete
