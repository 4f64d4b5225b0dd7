"""Cost model: topologies of devices and links, and alpha-beta collective costs (DESIGN.md §4).

>>> from automap.cost import Topology, collective_time
>>> collective_time("all-reduce", 1e9, ["data"], {"data": 8}, Topology.preset("h100-8")) > 0
True
"""
from automap.cost.collectives import collective_time, group_size, wire_bytes
from automap.cost.estimate import Collective, Estimate, estimate
from automap.cost.memory import MemoryEstimate, estimate_memory
from automap.cost.byte_counts import parse_bytes
from automap.cost.topology import DeviceSpec, Level, Link, Topology
from automap.cost.topology_presets import default_topology

__all__ = [
    "Collective", "DeviceSpec", "Estimate", "Level", "Link", "MemoryEstimate", "Topology",
    "collective_time", "default_topology", "estimate", "estimate_memory", "group_size", "parse_bytes",
    "wire_bytes",
]
