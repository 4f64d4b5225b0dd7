"""The machine a plan runs on: per-device compute and memory, and a link per mesh axis.

A `Topology` is a `DeviceSpec` plus either a hierarchy of `Level`s (innermost first: GPUs in a
node over NVLink, then nodes over InfiniBand) from which each mesh axis gets the link of the
slowest level it crosses, or explicit per-axis `links`, or both (explicit links win). Per-axis
links are how heterogeneous clusters are expressed (AMP-style, PRIOR_ART.md).

The presets and the default machine of a device count are in :mod:`automap.cost.topology_presets`;
byte counts such as ``"80GiB"`` are read by :mod:`automap.cost.byte_counts`.

>>> t = Topology.preset("h100-2x8")
>>> {a: l.bandwidth for a, l in t.links_for({"data": 2, "model": 8}).items()}
{'data': 50000000000.0, 'model': 450000000000.0}
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from automap.cost.byte_counts import parse_bytes
from automap.sub_axes import whole_axis

__all__ = ["Link", "DeviceSpec", "Level", "Topology"]

def _positive(owner: str, field: str, value: Any, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        need = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{owner}.{field} must be a finite number {need}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Link:
    """A point-to-point link: `bandwidth` in bytes/s per device per direction, `latency` in s.

    >>> Link(bandwidth=50e9, latency=5e-6).bandwidth
    50000000000.0
    """
    bandwidth: float
    latency: float

    def __post_init__(self):
        _positive("Link", "bandwidth", self.bandwidth)
        _positive("Link", "latency", self.latency, allow_zero=True)


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator: peak FLOP/s, memory capacity (an int or a string like ``"80GiB"``,
    stored as bytes) and memory bandwidth in bytes/s.

    >>> DeviceSpec("gpu", peak_flops=1e15, memory_bytes="80GiB", memory_bandwidth=3e12).memory_bytes
    85899345920
    """
    name: str
    peak_flops: float
    memory_bytes: int
    memory_bandwidth: float

    def __post_init__(self):
        object.__setattr__(self, "memory_bytes", parse_bytes(self.memory_bytes))
        _positive("DeviceSpec", "peak_flops", self.peak_flops)
        _positive("DeviceSpec", "memory_bandwidth", self.memory_bandwidth)


@dataclasses.dataclass(frozen=True)
class Level:
    """A level of the machine hierarchy: `size` children of the level below joined by `link`
    (e.g. ``Level(8, nvlink, "nvlink")`` for 8 GPUs in a node, then ``Level(2, ib, "ib")``).

    >>> Level(8, Link(450e9, 3e-6), "nvlink").size
    8
    """
    size: int
    link: Link
    name: str = ""

    def __post_init__(self):
        if not isinstance(self.size, int) or isinstance(self.size, bool) or self.size < 1:
            raise ValueError(f"Level.size must be an int >= 1, got {self.size!r}")
        if not isinstance(self.link, Link):
            raise TypeError(f"Level.link must be a Link(bandwidth, latency), got {self.link!r}")


@dataclasses.dataclass(frozen=True)
class Topology:
    """A device type plus the links between devices, per hierarchy level or per mesh axis.

    `levels` are innermost first; explicit `links` (mesh axis name -> `Link`) override them.
    The mapping of mesh axes to links is `links_for`. `links` is copied to a plain dict and must
    not be mutated; use `with_links` to derive a new topology.

    >>> t = Topology.preset("h100-8").with_links(model=Link(900e9, 1e-6))
    >>> t.link("model", {"data": 2, "model": 4}).bandwidth, t.num_devices
    (900000000000.0, 8)
    """
    name: str
    device: DeviceSpec
    levels: tuple[Level, ...] = ()
    links: Mapping[str, Link] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "levels", tuple(self.levels))
        object.__setattr__(self, "links", dict(self.links))
        object.__setattr__(self, "_links_memo", {})  # mesh (axis, size) pairs -> links_for's answer
        if not isinstance(self.device, DeviceSpec):
            raise TypeError(f"Topology.device must be a DeviceSpec, got {self.device!r}")
        for lv in self.levels:
            if not isinstance(lv, Level):
                raise TypeError(f"Topology.levels must hold Level(size, link, name), got {lv!r}")
        for axis, link in self.links.items():
            if not isinstance(link, Link):
                raise TypeError(f"Topology.links[{axis!r}] must be a Link(bandwidth, latency), "
                                f"got {link!r}")

    def __hash__(self):
        return hash((self.name, self.device, self.levels, tuple(sorted(self.links.items()))))

    @property
    def platform(self) -> str | None:
        """The JAX backend its devices are (``"cpu"``, ``"gpu"`` or ``"tpu"``), read off the
        preset family of its name (``cpu-sim``, ``h100-2x8``, ``tpu-v5e-8``, and
        `default_topology`'s sizes of them); None for a custom name. What a platform's compiler
        makes of some primitives differs (the FLOPs of a ragged dot, which collectives it combines).

        >>> [Topology.preset(n).platform for n in ("cpu-sim", "h100-2x8", "tpu-v5p-8")]
        ['cpu', 'gpu', 'tpu']
        """
        from automap.cost.topology_presets import PLATFORMS

        return PLATFORMS.get(self.name.split("-")[0])

    @property
    def num_devices(self) -> int | None:
        """Devices in the hierarchy (product of level sizes), None without levels.

        >>> Topology.preset("tpu-v5p-2x64").num_devices
        128
        """
        return math.prod(lv.size for lv in self.levels) if self.levels else None

    def links_for(self, axes: Mapping[str, int]) -> dict[str, Link]:
        """Mesh axis name -> `Link`, for a mesh given as ordered ``{axis: size}`` (``mesh.shape``).

        An explicit ``links[axis]`` wins (for its sub-axes too, :mod:`automap.sub_axes`). Otherwise devices are laid out in mesh order, row-major
        (the last axis varies fastest, as ``jax.make_mesh`` does): an axis's devices are
        ``stride`` apart (the product of the sizes of the axes after it) and span
        ``stride * size`` devices, so it crosses a level's boundary when that exceeds the devices
        below and in that level (when sizes do not divide, any group straddling a boundary
        counts). Each axis gets the link of the outermost level it crosses; an axis of size 1
        gets the fastest (innermost) link.

        >>> t = Topology.preset("h100-2x8")   # 2 nodes x 8 GPUs
        >>> {a: l.bandwidth for a, l in t.links_for({"data": 2, "model": 8}).items()}
        {'data': 50000000000.0, 'model': 450000000000.0}
        >>> {a: l.bandwidth for a, l in t.links_for({"model": 8, "data": 2}).items()}
        {'model': 50000000000.0, 'data': 450000000000.0}
        >>> t.links_for({"data": 16})["data"].bandwidth
        50000000000.0
        """
        key = tuple(axes.items())
        got = self._links_memo.get(key)
        if got is None:
            got = self._links_memo[key] = self._links_for(dict(axes))
        return dict(got)

    def _links_for(self, sizes: dict[str, int]) -> dict[str, Link]:
        for axis, size in sizes.items():
            if not isinstance(size, (int, np.integer)) or size < 1:
                raise ValueError(f"mesh axis {axis!r} has size {size!r}; sizes must be ints >= 1")
        implicit = [a for a in sizes if whole_axis(a) not in self.links]
        out: dict[str, Link] = {}
        if implicit:
            if not self.levels:
                raise ValueError(
                    f"topology {self.name!r} has no link for mesh axes {implicit} and no levels; "
                    f"give it links for them (topology.with_links({implicit[0]}=Link(bw, lat))) "
                    f"or levels")
            total = math.prod(sizes.values())
            if total > self.num_devices:
                raise ValueError(
                    f"mesh {sizes} has {total} devices but topology {self.name!r} has "
                    f"{self.num_devices} ({' x '.join(str(lv.size) for lv in self.levels)}); "
                    f"use a larger topology, add a Level, or give explicit links per axis")
            ids = np.arange(total).reshape(tuple(sizes.values()) or ())
            bounds = np.cumprod([lv.size for lv in self.levels])
            for dim, axis in enumerate(sizes):
                out[axis] = self.levels[0].link
                for lv, bound in zip(self.levels[1:], bounds[:-1], strict=True):
                    if sizes[axis] > 1 and np.ptp(ids // bound, axis=dim).any():
                        out[axis] = lv.link
        return {a: self.links[whole_axis(a)] if whole_axis(a) in self.links else out[a] for a in sizes}

    def link(self, axis: str, axes: Mapping[str, int]) -> Link:
        """The link of one mesh axis; see `links_for`.

        >>> Topology.preset("tpu-v5p-2x64").link("dp", {"dp": 2, "fsdp": 64}).bandwidth
        25000000000.0
        """
        if axis not in axes:
            raise ValueError(f"axis {axis!r} is not a mesh axis; the mesh has {list(axes)}")
        return self.links_for(axes)[axis]

    def with_links(self, **links: Link) -> Topology:
        """A copy whose explicit per-axis links are updated with `links`.

        >>> Topology.preset("cpu-sim").with_links(data=Link(1e9, 1e-4)).links["data"].latency
        0.0001
        """
        return dataclasses.replace(self, links={**self.links, **links})

    @staticmethod
    def presets() -> tuple[str, ...]:
        """Names accepted by `preset`.

        >>> Topology.presets()[:2]
        ('h100-8', 'h100-2x8')
        """
        from automap.cost.topology_presets import PRESETS

        return tuple(PRESETS)

    @staticmethod
    def preset(name: str) -> Topology:
        """A named preset (see the module docstring for the numbers).

        >>> Topology.preset("tpu-v5e-8").device.peak_flops
        197000000000000.0
        """
        from automap.cost.topology_presets import PRESETS

        if name not in PRESETS:
            raise ValueError(f"unknown topology preset {name!r}; choose one of "
                             f"{', '.join(PRESETS)} or build one with Topology.from_dict")
        return PRESETS[name]

    @staticmethod
    def from_dict(d: Mapping[str, Any]) -> Topology:
        """Build from a small dict: keys ``name``, ``device`` (``name``, ``peak_flops``,
        ``memory_bytes`` as int or ``"80GiB"``, ``memory_bandwidth``), ``levels`` (a list of
        ``{"size", "bandwidth", "latency", "name"}``) and ``links`` (axis ->
        ``{"bandwidth", "latency"}``). With ``preset``, start from that preset: ``device``
        fields are overridden one by one, ``links`` merged, ``levels`` replaced.

        >>> t = Topology.from_dict({"device": {"peak_flops": 1e15, "memory_bytes": "80GiB",
        ...                                    "memory_bandwidth": 3.35e12},
        ...                         "links": {"data": {"bandwidth": 50e9, "latency": 5e-6}}})
        >>> t.device.memory_bytes, t.link("data", {"data": 4}).bandwidth
        (85899345920, 50000000000.0)
        >>> Topology.from_dict({"preset": "h100-8", "device": {"memory_bytes": "40GB"}}).device.name
        'H100-SXM'
        """
        _check_keys("topology", d, {"name", "preset", "device", "levels", "links"})
        base = Topology.preset(d["preset"]) if "preset" in d else None
        dev = dict(d.get("device", {}))
        _check_keys("device", dev, {f.name for f in dataclasses.fields(DeviceSpec)})
        if base is not None:
            dev = {**dataclasses.asdict(base.device), **dev}
        else:
            missing = {"peak_flops", "memory_bytes", "memory_bandwidth"} - set(dev)
            if missing:
                raise ValueError(f"topology dict needs device fields {sorted(missing)} "
                                 f"(or a 'preset' to start from)")
            dev.setdefault("name", "device")
        links = {a: _link(f"links[{a!r}]", l) for a, l in d.get("links", {}).items()}
        if "levels" in d:
            levels = []
            for i, lv in enumerate(d["levels"]):
                _check_keys(f"levels[{i}]", lv, {"size", "bandwidth", "latency", "name"})
                link = _link(f"levels[{i}]", {k: v for k, v in lv.items()
                                              if k in ("bandwidth", "latency")})
                levels.append(Level(lv["size"], link, lv.get("name", "")))
        else:
            levels = base.levels if base is not None else ()
        return Topology(name=d.get("name", base.name if base is not None else "custom"),
                        device=DeviceSpec(**dev), levels=tuple(levels),
                        links={**(base.links if base is not None else {}), **links})

    def to_dict(self) -> dict[str, Any]:
        """The inverse of `from_dict` (plain numbers, no preset).

        >>> t = Topology.preset("h100-2x8")
        >>> Topology.from_dict(t.to_dict()) == t
        True
        """
        return {"name": self.name, "device": dataclasses.asdict(self.device),
                "levels": [{"size": lv.size, "bandwidth": lv.link.bandwidth,
                            "latency": lv.link.latency, "name": lv.name} for lv in self.levels],
                "links": {a: dataclasses.asdict(l) for a, l in self.links.items()}}


def _check_keys(where: str, d: Any, allowed: set[str]) -> None:
    if not isinstance(d, Mapping):
        raise TypeError(f"{where} must be a dict, got {d!r}")
    extra = set(d) - allowed
    if extra:
        raise ValueError(f"unknown keys {sorted(extra)} in {where}; allowed: {sorted(allowed)}")


def _link(where: str, d: Any) -> Link:
    if isinstance(d, Link):
        return d
    _check_keys(where, d, {"bandwidth", "latency"})
    if set(d) != {"bandwidth", "latency"}:
        raise ValueError(f"{where} needs both 'bandwidth' (bytes/s) and 'latency' (s), got {d!r}")
    return Link(float(d["bandwidth"]), float(d["latency"]))
