"""Named machines (`Topology.preset`) and the default machine of a device count (`default_topology`).

Presets (approximate public figures):

============  =======  =======  ======  =======  ==============================================
name          devices  FLOP/s   HBM     HBM B/s  levels, innermost first: size bandwidth latency
============  =======  =======  ======  =======  ==============================================
h100-8        8        989e12   80GiB   3.35e12  nvlink 8 450e9 3e-6
h100-2x8      2 x 8    989e12   80GiB   3.35e12  nvlink 8 450e9 3e-6; infiniband 2 50e9 5e-6
tpu-v5e-8     8        197e12   16GiB   819e9    ici 8 100e9 1e-6
tpu-v5e-256   256      197e12   16GiB   819e9    ici 256 100e9 1e-6
tpu-v5p-8     8        459e12   95GiB   2.76e12  ici 8 200e9 1e-6
tpu-v5p-2x64  2 x 64   459e12   95GiB   2.76e12  ici 64 200e9 1e-6; dcn 2 25e9 1e-5
cpu-sim       8        50e9     4GiB    10e9     host 8 5e9 1e-5
============  =======  =======  ======  =======  ==============================================

`default_topology(num_devices)` sizes the backend's family to any device count: CPU simulation is
one host of ``num_devices`` (cpu-sim's device and link), GPUs are nodes of 8 H100 over NVLink
joined by InfiniBand (``h100-8x8`` for 64), TPUs are one v5e ICI slice of up to 256 chips, slices
joined by DCN beyond that.

FLOP/s are dense bf16 peaks; bandwidths are bytes/s per device per direction; latencies seconds.
Where the numbers come from: H100 SXM NVLink 4 is 900 GB/s bidirectional per GPU (450e9 one
way); InfiniBand NDR is 400 Gb/s per GPU (50e9 B/s). TPU v5e ICI is 1,600 Gb/s per chip
(200e9 B/s) over a 2D torus, so one mesh axis (one torus dimension, two ports) gets about half,
100e9; v5p ICI is 4,800 Gb/s per chip (600e9 B/s) over a 3D torus, one dimension about 200e9;
DCN between v5p slices about 25e9 B/s per chip. Preset names count JAX devices (chips); Google
Cloud's ``v5p-N`` counts TensorCores, so our ``tpu-v5p-8`` is Cloud's v5p-16. ``cpu-sim`` models
the simulated CPU devices of the test suite; its numbers only need to be self-consistent.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from automap.cost.topology import DeviceSpec, Level, Link, Topology

__all__ = ["PRESETS", "PLATFORMS", "default_topology"]

PLATFORMS = {"cpu": "cpu", "h100": "gpu", "tpu": "tpu"}  # preset family -> JAX backend
_H100 = DeviceSpec("H100-SXM", 989e12, "80GiB", 3.35e12)
_V5E = DeviceSpec("TPU-v5e", 197e12, "16GiB", 819e9)
_V5P = DeviceSpec("TPU-v5p", 459e12, "95GiB", 2.76e12)
_NVLINK = Link(450e9, 3e-6)
_IB = Link(50e9, 5e-6)
_ICI_V5E = Link(100e9, 1e-6)
_ICI_V5P = Link(200e9, 1e-6)
_DCN = Link(25e9, 1e-5)

PRESETS: dict[str, Topology] = {t.name: t for t in (
    Topology("h100-8", _H100, (Level(8, _NVLINK, "nvlink"),)),
    Topology("h100-2x8", _H100, (Level(8, _NVLINK, "nvlink"), Level(2, _IB, "infiniband"))),
    Topology("tpu-v5e-8", _V5E, (Level(8, _ICI_V5E, "ici"),)),
    Topology("tpu-v5e-256", _V5E, (Level(256, _ICI_V5E, "ici"),)),
    Topology("tpu-v5p-8", _V5P, (Level(8, _ICI_V5P, "ici"),)),
    Topology("tpu-v5p-2x64", _V5P, (Level(64, _ICI_V5P, "ici"), Level(2, _DCN, "dcn"))),
    Topology("cpu-sim", DeviceSpec("cpu", 50e9, "4GiB", 10e9),
             (Level(8, Link(5e9, 1e-5), "host"),)),
)}


def default_topology(num_devices: int | None = None, backend: str | None = None) -> Topology:
    """The default machine of ``num_devices`` devices (default: ``jax.device_count()``) for
    ``backend`` (default: ``jax.default_backend()``; anything but gpu and tpu is cpu): the presets
    up to 8 devices (cpu-sim, h100-8, tpu-v5e-8); for more, cpu: one host of ``num_devices`` with
    cpu-sim's link; gpu: nodes of 8 H100 over NVLink joined by InfiniBand (a partial last node
    counts whole); tpu: one v5e ICI slice of up to 256 chips, slices of 256 joined by DCN.

    >>> default_topology(8, "cpu") == Topology.preset("cpu-sim")
    True
    >>> default_topology(16, "gpu") == Topology.preset("h100-2x8")
    True
    >>> t = default_topology(64, "gpu")
    >>> t.name, {a: l.bandwidth for a, l in t.links_for({"node": 8, "gpu": 8}).items()}
    ('h100-8x8', {'node': 50000000000.0, 'gpu': 450000000000.0})
    >>> [default_topology(n, b).name for n, b in [(1024, "cpu"), (64, "tpu"), (512, "tpu")]]
    ['cpu-sim-1024', 'tpu-v5e-64', 'tpu-v5e-2x256']
    """
    import jax

    n = jax.device_count() if num_devices is None else num_devices
    if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 1:
        raise ValueError(f"default_topology: num_devices must be an int >= 1, got {num_devices!r}")
    n = int(n)
    backend = jax.default_backend() if backend is None else backend
    if n <= 8:
        return PRESETS[{"gpu": "h100-8", "tpu": "tpu-v5e-8"}.get(backend, "cpu-sim")]
    if backend == "gpu":
        nodes = -(-n // 8)
        return Topology(f"h100-{nodes}x8", _H100, (Level(8, _NVLINK, "nvlink"), Level(nodes, _IB, "infiniband")))
    if backend == "tpu":
        if n <= 256:
            return Topology(f"tpu-v5e-{n}", _V5E, (Level(n, _ICI_V5E, "ici"),))
        slices = -(-n // 256)
        return Topology(f"tpu-v5e-{slices}x256", _V5E, (Level(256, _ICI_V5E, "ici"), Level(slices, _DCN, "dcn")))
    sim = PRESETS["cpu-sim"]
    return Topology(f"cpu-sim-{n}", sim.device, (dataclasses.replace(sim.levels[0], size=n),))
