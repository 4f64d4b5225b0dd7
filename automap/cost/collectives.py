"""Alpha-beta ring costs of collectives over one or several mesh axes (DESIGN.md section 4).

``time = steps * latency + wire_bytes / bandwidth`` for a group of ``n`` devices, the product of
the sizes of the axes involved. ``nbytes`` (``S``) is the full per-device buffer the collective
works on, as in `automap.measure`: the buffer for all-reduce, all-to-all and collective-permute,
the gathered result for all-gather, the un-scattered operand for reduce-scatter.

==================  =============  ==============
kind                steps          wire bytes
==================  =============  ==============
all-reduce          2(n-1)         2(n-1)/n * S
all-gather          n-1            (n-1)/n * S
reduce-scatter      n-1            (n-1)/n * S
all-to-all          n-1            (n-1)/n^2 * S
collective-permute  1              S
==================  =============  ==============

Over several axes the ring runs over the product group; its bandwidth is the slowest of the
axes' links and its latency the largest (a flat ring is as slow as its slowest hop).

>>> from automap.cost.topology import Topology
>>> t = Topology.preset("h100-2x8")
>>> mesh = {"data": 2, "model": 8}
>>> collective_time("all-reduce", 1e9, ["model"], mesh, t) < collective_time(
...     "all-reduce", 1e9, ["data"], mesh, t)
True
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from automap.cost.topology import Topology
from automap.measure import KINDS, CollectiveKind

__all__ = ["CollectiveKind", "KINDS", "group_size", "wire_bytes", "collective_time"]

# kind -> (latency steps, wire-byte factor), both as functions of the group size n
_RING: dict[str, tuple] = {
    "all-reduce": (lambda n: 2 * (n - 1), lambda n: 2 * (n - 1) / n),
    "all-gather": (lambda n: n - 1, lambda n: (n - 1) / n),
    "reduce-scatter": (lambda n: n - 1, lambda n: (n - 1) / n),
    # DESIGN section 4's figure, kept as written: it is the traffic to ONE peer ((n-1)/n of S/n);
    # the total a device sends over all its peers is (n-1)/n * S.
    "all-to-all": (lambda n: n - 1, lambda n: (n - 1) / n**2),
    "collective-permute": (lambda n: 1, lambda n: 1.0),
}
assert tuple(_RING) == KINDS


def _check_kind(kind: str) -> None:
    if kind not in _RING:
        raise ValueError(f"unknown collective kind {kind!r}; use one of {', '.join(KINDS)}")


def _axes(axes: Sequence[str] | str) -> tuple[str, ...]:
    # a bare string is one axis name, not a sequence of one-letter axes
    return (axes,) if isinstance(axes, str) else tuple(axes)


def group_size(axes: Sequence[str] | str, mesh_axes: Mapping[str, int]) -> int:
    """Devices in one group of a collective over `axes`: the product of their sizes.

    >>> group_size(["data", "model"], {"data": 2, "model": 4, "pipe": 3}), group_size([], {"x": 2})
    (8, 1)
    """
    axes = _axes(axes)
    unknown = [a for a in axes if a not in mesh_axes]
    if unknown:
        raise ValueError(f"collective over axes {unknown} not in the mesh; the mesh axes are "
                         f"{list(mesh_axes)}")
    if len(set(axes)) != len(axes):
        raise ValueError(f"collective axes {list(axes)} repeat an axis; name each axis once")
    return math.prod(mesh_axes[a] for a in axes)


def wire_bytes(kind: CollectiveKind, nbytes: float, n: int) -> float:
    """Bytes each device puts on the wire in a ring collective of `n` devices over a buffer of
    `nbytes` (see the table in the module docstring); 0 when ``n == 1``.

    >>> [wire_bytes(k, 800, 4) for k in ("all-reduce", "all-gather", "all-to-all")]
    [1200.0, 600.0, 150.0]
    >>> wire_bytes("collective-permute", 800, 1)
    0.0
    """
    _check_kind(kind)
    if n < 1:
        raise ValueError(f"group size must be >= 1, got {n}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    return 0.0 if n == 1 else _RING[kind][1](n) * nbytes


def collective_time(kind: CollectiveKind, nbytes: float, axes: Sequence[str] | str,
                    mesh_axes: Mapping[str, int], topology: Topology) -> float:
    """Seconds for one collective of `kind` over `nbytes` across the mesh `axes`:
    ``steps * latency + wire_bytes / bandwidth``, with the slowest bandwidth and largest latency
    among the axes' links (`Topology.links_for`). A group of one device costs 0.

    >>> from automap.cost.topology import Topology
    >>> t = Topology.preset("cpu-sim")   # 5e9 B/s, 1e-5 s per hop
    >>> round(collective_time("all-gather", 4e6, ["x"], {"x": 4, "y": 2}, t), 6)  # 3 steps, 3e6 B
    0.00063
    >>> collective_time("all-reduce", 4e6, ["x"], {"x": 1, "y": 8}, t)
    0.0
    """
    _check_kind(kind)
    axes = _axes(axes)
    n = group_size(axes, mesh_axes)
    if n == 1:
        return 0.0
    links = topology.links_for(mesh_axes)
    # Flat ring over the product group. A hierarchical alternative (not used): run the collective
    # over each axis in turn, innermost first, on the buffer left after the previous stage, e.g.
    # all-reduce = reduce-scatter(inner) + all-reduce(outer, S/n_inner) + all-gather(inner).
    group = [links[a] for a in axes if mesh_axes[a] > 1]
    bandwidth = min(l.bandwidth for l in group)
    latency = max(l.latency for l in group)
    return _RING[kind][0](n) * latency + wire_bytes(kind, nbytes, n) / bandwidth
