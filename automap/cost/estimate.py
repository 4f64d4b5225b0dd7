"""The cost of a plan: per-device FLOPs, collectives, peak memory and an estimated step time."""
from __future__ import annotations

import collections
import dataclasses
import math
from typing import Iterable, Mapping

from automap.cost.collectives import collective_time
from automap.cost.flops import dot_flops, op_bytes, op_flops
from automap.cost.memory import MemoryEstimate, estimate_memory
from automap.cost.topology import Topology
from automap.propagate import analyse
from automap.shardings import ShardingState


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective the plan implies, with the op that causes it."""

    kind: str
    axes: tuple[str, ...]
    bytes: int  # per device, per execution (the buffer it works on)
    count: int
    op: int
    value: int
    primitive: str
    module: str
    time_s: float  # all executions


@dataclasses.dataclass(frozen=True)
class Estimate:
    """What a plan costs per device and per step, from the cost model alone."""

    flops: float
    dot_flops: float
    bytes_accessed: float
    collectives: tuple[Collective, ...]
    memory: MemoryEstimate
    compute_time_s: float
    comm_time_s: float

    @property
    def time_s(self) -> float:
        """Step time: compute plus communication (no overlap assumed)."""
        return self.compute_time_s + self.comm_time_s

    @property
    def peak_memory_bytes(self) -> int:
        return self.memory.peak

    @property
    def comm_bytes(self) -> Mapping[str, int]:
        """Collective bytes per kind (count included)."""
        out: dict[str, int] = collections.defaultdict(int)
        for c in self.collectives:
            out[c.kind] += c.bytes * c.count
        return dict(out)

    @property
    def comm_bytes_by_axis(self) -> Mapping[str, int]:
        out: dict[str, int] = collections.defaultdict(int)
        for c in self.collectives:
            out["+".join(c.axes)] += c.bytes * c.count
        return dict(out)

    @property
    def collective_bytes(self) -> int:
        return sum(c.bytes * c.count for c in self.collectives)

    def summary(self) -> str:
        lines = [
            f"estimated step time {self.time_s * 1e3:.3f} ms (compute {self.compute_time_s * 1e3:.3f} ms, "
            f"communication {self.comm_time_s * 1e3:.3f} ms)",
            f"per device: {self.flops:.4g} FLOPs ({self.dot_flops:.4g} in dots), peak memory "
            f"{self.memory.peak} B (arguments {self.memory.arguments} + outputs {self.memory.outputs} "
            f"- aliased {self.memory.aliased} + temporaries {self.memory.temp})",
        ]
        for kind, nbytes in sorted(self.comm_bytes.items()):
            count = sum(c.count for c in self.collectives if c.kind == kind)
            lines.append(f"  {kind:<15} {count:>5}x {nbytes:>12} B")
        return "\n".join(lines)


def estimate(state: ShardingState, topology: Topology | None = None, *, donated: Iterable[int] = ()) -> Estimate:
    """Estimate the per-device cost of running ``state.program`` sharded as ``state`` says.

    >>> import jax, jax.numpy as jnp
    >>> from automap.ir.lower import lower
    >>> from automap.propagate import apply
    >>> from automap.shardings import Action
    >>> prog = lower(jax.make_jaxpr(lambda x, w: x @ w)(jnp.ones((8, 4)), jnp.ones((4, 2))), ["x", "w"], ["y"])
    >>> s = apply(ShardingState.initial(prog, {"data": 2}), [Action(prog.inputs[1], 0, "data")])
    >>> e = estimate(s)
    >>> e.dot_flops, e.comm_bytes   # the contraction is split: half the FLOPs, an all-reduce of y
    (64.0, {'all-reduce': 64})
    """
    topology = topology or Topology.preset("cpu-sim")
    program, axes = state.program, state.axes
    device = topology.device
    static = program.memo.get("op_costs")
    if static is None:  # flops, bytes and dot flops of every op, from shapes alone
        static = program.memo["op_costs"] = {
            op.id: (op_flops(program, op), op_bytes(program, op), dot_flops(program, op)) for op in program.all_ops
        }
    flops = dots = traffic = compute = 0.0
    op_list, all_reshards = analyse(state)
    for op, mult, fax in op_list:
        f, b, d = static[op.id]
        if not (f or b):
            continue
        split = math.prod(axes[a] for ax in fax.values() for a in ax)
        f, b = f / split * mult, b / split * mult
        flops += f
        if d and _is_real_dot(program, op, fax, axes):
            dots += d / split * mult
        traffic += b
        compute += max(f / device.peak_flops, b / device.memory_bandwidth)
    ops = {op.id: op for op, _, _ in op_list}
    collectives = []
    for r in all_reshards:
        if r.reused or math.prod(axes[a] for a in r.axes) == 1:  # reused (CSE) or over size-1 axes: free
            continue
        op = ops[r.op]
        t = collective_time(r.kind, r.bytes, r.axes, axes, topology) * r.count
        collectives.append(Collective(r.kind, r.axes, r.bytes, r.count, r.op, r.value, op.primitive, op.name, t))
    memory = estimate_memory(state, donated=donated, reshards=all_reshards)
    return Estimate(
        flops, dots, traffic, tuple(collectives), memory, compute, sum(c.time_s for c in collectives)
    )


def _is_real_dot(program, op, fax, axes) -> bool:
    """XLA rewrites a dot whose per-device contraction has size 1 (an outer product, e.g. a
    weight gradient with one example per device) into a multiply: not a dot any more."""
    if op.primitive != "dot_general":
        return False
    contraction = 1
    for f in op.rule.reduction_factors:
        contraction *= op.rule.factors[f].size // math.prod(axes[a] for a in fax.get(f, ()))
    return contraction > 1


def default_topology() -> Topology:
    """The preset matching the default JAX backend: cpu -> cpu-sim, gpu -> h100-8, tpu -> tpu-v5e-8."""
    import jax

    backend = jax.default_backend()
    return Topology.preset({"gpu": "h100-8", "tpu": "tpu-v5e-8"}.get(backend, "cpu-sim"))
