"""automap: automatic SPMD partitioning for JAX train steps.

>>> import automap
>>> sorted(n for n in automap.__all__ if n[0].islower())[:3]
['automap', 'lower', 'make_mesh']
"""
from automap import rules, zoo
from automap.api import Partitioned, Plan, automap, make_mesh, partition
from automap.ir.lower import lower
from automap.ir.program import Op, Program, Region, Value
from automap.measure import CollectiveOp, CollectiveStat, Measurement, MemoryStat, measure
from automap.shardings import Action, ShardingError, ShardingState
from automap.trace import trace

__all__ = [
    "Action", "CollectiveOp", "CollectiveStat", "Measurement", "MemoryStat", "Op", "Partitioned", "Plan", "Program", "Region", "ShardingError", "ShardingState", "Value",
    "automap", "lower", "make_mesh", "measure", "partition", "rules", "trace", "zoo",
]
