"""automap: automatic SPMD partitioning for JAX train steps.

>>> import automap
>>> sorted(n for n in automap.__all__ if n[0].islower())[:4]
['automap', 'checkpoint', 'cost', 'lower']
"""
from automap import cost, rules, zoo
from automap.api import Partitioned, automap, make_mesh, partition
from automap.plan import Plan
from automap.cost import Estimate, Topology
from automap.ir.lower import lower
from automap.ir.program import Op, Program, Region, Value
from automap.measure import CollectiveOp, CollectiveStat, Measurement, MemoryStat, measure
from automap.profile import Profile, profile
from automap.shardings import Action, ShardingError, ShardingState
from automap.trace import trace
from automap.verify import Fidelity, FidelityWarning

from automap import checkpoint, plan_io  # noqa: E402  (after the API they build on)
from automap.plan_io import PlanMismatchError  # noqa: E402

__all__ = [
    "Action", "CollectiveOp", "CollectiveStat", "Estimate", "Fidelity", "FidelityWarning", "Measurement", "MemoryStat", "Op", "Partitioned",
    "Plan", "PlanMismatchError", "Profile", "Program", "Region", "ShardingError", "ShardingState", "Topology",
    "Value", "automap", "checkpoint", "cost", "lower", "make_mesh", "measure", "partition", "plan_io", "profile",
    "rules", "trace", "zoo",
]
