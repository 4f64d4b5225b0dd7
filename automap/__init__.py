"""automap: automatic SPMD partitioning for JAX train steps.

>>> import automap
>>> sorted(n for n in automap.__all__ if n[0].islower())[:3]
['automap', 'cost', 'lower']
"""
from automap import cost, rules, zoo
from automap.cost import Estimate, Topology
from automap.api import Partitioned, Plan, automap, make_mesh, partition
from automap.ir.lower import lower
from automap.ir.program import Op, Program, Region, Value
from automap.profile import Profile, profile
from automap.measure import CollectiveOp, CollectiveStat, Measurement, MemoryStat, measure
from automap.shardings import Action, ShardingError, ShardingState
from automap.trace import trace

__all__ = [
    "Action", "CollectiveOp", "Estimate", "Topology", "CollectiveStat", "Measurement", "MemoryStat", "Op", "Partitioned", "Plan", "Profile", "Program", "Region", "ShardingError", "ShardingState", "Value",
    "automap", "cost", "lower", "make_mesh", "measure", "partition", "profile", "rules", "trace", "zoo",
]
