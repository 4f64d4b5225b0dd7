"""The cost of a plan: per-device FLOPs, collectives, peak memory and an estimated step time."""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
import operator
from typing import Iterable, Mapping

import numpy as np

from automap.analysis import Analysis, Reshard, op_analyses, reshards
from automap.cost.collectives import collective_time, group_size, wire_bytes
from automap.cost.combine import combine_groups, combined_kinds, latency_charges
from automap.cost.flops import dot_flops, fused_op_bytes, op_flops
from automap.cost.memory import MemoryEstimate, estimate_memory
from automap.cost.topology import DeviceSpec, Topology
from automap.cost.cpu_float32 import computed_itemsize
from automap.ir.program import Op, Program
from automap.rules import traits_of
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
    combined: bool = False  # XLA merges it into an earlier one of its kind: no latency of its own
    combine_key: tuple | None = None  # the group XLA may combine it with (None: a kind it never combines)
    wire_bytes: float = 0.0  # bytes one device sends, all executions (ring traffic)


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

    @functools.cached_property  # the search's objective reads it at every comparison
    def wire_bytes(self) -> float:
        """Bytes each device sends per step (`automap.measure.Measurement.wire_bytes`'s estimate)."""
        return sum(c.wire_bytes for c in self.collectives)

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
    flops, dots, traffic, compute = _op_totals(program, op_analyses(state), axes, device, topology.platform)
    priced = _priced(topology, state)
    collectives, kept = [], []
    all_reshards = reshards(state)
    for r in all_reshards:
        got = priced.get(id(r))
        if got is None or got[0] is not r:
            got = priced[id(r)] = (r, _collective(r, program, axes, topology))
        if got[1] is not None:
            collectives.append(got[1])
            kept.append(r)
    collectives = _combined(program, kept, collectives, axes, topology, priced)
    memory = estimate_memory(state, donated=donated, reshards=all_reshards, platform=topology.platform)
    return Estimate(
        flops, dots, traffic, tuple(collectives), memory, compute, sum(c.time_s for c in collectives)
    )


_EXACT = 2**53  # ints below this are exact as floats: numpy then divides exactly as Python does


@dataclasses.dataclass(frozen=True)
class _OpCosts:
    """FLOPs, bytes and dot FLOPs of every op (in walk order) from shapes alone, as a platform
    compiles them, as lists and as float arrays with the trip multipliers (``exact``: every number
    is below 2**53)."""

    static: list[tuple[int, int, int]]
    flops: np.ndarray
    bytes: np.ndarray
    mult: np.ndarray
    dots: tuple[int, ...]  # positions of the ops with dot FLOPs
    exact: bool
    quadratic: tuple[tuple[int, int], ...] = ()  # (position, factor): FLOPs quadratic in it (Traits.platform_quadratic)

    @staticmethod
    def of(program: Program, platform: str | None = None) -> _OpCosts:
        got = program.memo.get(("op_costs", platform))
        if got is None:
            static = [
                (op_flops(program, op, platform), nbytes, dot_flops(program, op, platform))
                for (op, _), nbytes in zip(program.walked, fused_op_bytes(program), strict=True)
            ]
            mults = [mult for _, mult in program.walked]
            exact = all(max(c) < _EXACT for c in static) and max(mults, default=0) < _EXACT
            got = program.memo[("op_costs", platform)] = _OpCosts(
                static, np.array([c[0] for c in static], dtype=np.float64),
                np.array([c[1] for c in static], dtype=np.float64), np.array(mults, dtype=np.float64),
                tuple(i for i, c in enumerate(static) if c[2]), exact, _quadratic(program, platform),
            )
        return got


def _quadratic(program: Program, platform: str | None) -> tuple[tuple[int, int], ...]:
    """(position, factor) of the ops whose FLOPs on ``platform`` grow with a factor's square."""
    out = []
    for i, (op, _) in enumerate(program.walked):
        fn = traits_of(op.primitive).quadratic_on(platform)
        factor = fn(op.rule, **op.params) if fn is not None and op.rule is not None else None
        if factor is not None:
            out.append((i, factor))
    return tuple(out)


def _split(costs: _OpCosts, analyses: list[Analysis], axes: Mapping[str, int]) -> np.ndarray:
    """Into how many pieces each op's work divides per device: its execution factors' splits, a
    factor its FLOPs are quadratic in counted twice."""
    split = np.fromiter(map(_PIECES, analyses), dtype=np.float64, count=len(analyses))
    for i, factor in costs.quadratic:
        split[i] *= math.prod(axes[a] for a in analyses[i][0].get(factor, ()))
    return split


def _op_totals(program: Program, analyses: list[Analysis], axes: Mapping[str, int],
               device: DeviceSpec, platform: str | None = None) -> tuple[float, float, float, float]:
    """(FLOPs, dot FLOPs, bytes, compute seconds) per device over every op, each op's work split
    by its execution factors. Summed op by op in program order, so numpy's elementwise terms
    are the very floats the Python loop (:func:`_op_totals_loop`) makes; that loop is used where
    a number is too large for a float to hold exactly."""
    costs = _OpCosts.of(program, platform)
    split = _split(costs, analyses, axes)
    if not costs.exact or split.max(initial=0) >= _EXACT:
        return _op_totals_loop(program, costs.static, analyses, split, axes, device)
    f = costs.flops / split * costs.mult
    b = costs.bytes / split * costs.mult
    c = np.maximum(f / float(device.peak_flops), b / float(device.memory_bandwidth))
    dots = 0.0
    for i in costs.dots:
        op, mult = program.walked[i]
        if _is_real_dot(program, op, analyses[i][0], axes):
            dots += costs.static[i][2] / float(split[i]) * mult
    return _running_sum(f), dots, _running_sum(b), _running_sum(c)


def _op_totals_loop(program: Program, static: list, analyses: list[Analysis], splits: np.ndarray,
                    axes: Mapping[str, int], device: DeviceSpec) -> tuple[float, float, float, float]:
    flops = dots = traffic = compute = 0.0
    for (op, mult), (f, b, d), (fax, _, _), split in zip(program.walked, static, analyses, splits.tolist(),
                                                         strict=True):
        if not (f or b):
            continue
        f, b = f / split * mult, b / split * mult
        flops += f
        if d and _is_real_dot(program, op, fax, axes):
            dots += d / split * mult
        traffic += b
        compute += max(f / device.peak_flops, b / device.memory_bandwidth)
    return flops, dots, traffic, compute


def _running_sum(terms: np.ndarray) -> float:
    """``0.0 + terms[0] + terms[1] + ...`` left to right (numpy's sum pairs terms up: other floats).
    Ops without work add 0.0, which changes nothing."""
    return functools.reduce(operator.add, terms.tolist(), 0.0)


_PIECES = operator.itemgetter(2)


def _collective(r: Reshard, program: Program, axes: Mapping[str, int], topology: Topology) -> Collective | None:
    """What a reshard costs: None where it is free (reused by CSE, or over axes of size 1)."""
    if r.reused or math.prod(axes[a] for a in r.axes) == 1:
        return None
    op = _ops_by_id(program)[r.op]
    value = program.values[r.value]
    itemsize = value.itemsize
    kind = r.kind
    if r.where == "result" and r.kind in ("all-reduce", "reduce-scatter"):  # partial sums, in the op's own dtype
        traits = traits_of(op.primitive)
        itemsize = traits.partial_itemsize_on(topology.platform, value.dtype)
        if kind == "reduce-scatter" and not traits.scatters_partial_on(topology.platform, value.dtype):
            kind = "all-reduce"  # then sliced
    if topology.platform == "cpu":  # XLA:CPU moves bfloat16 intermediates as float32
        itemsize = max(itemsize, computed_itemsize(value))
    nbytes = r.bytes * itemsize // max(value.itemsize, 1)
    t = collective_time(kind, nbytes, r.axes, axes, topology) * r.count
    sent = wire_bytes(kind, nbytes * r.count, r.group or group_size(r.axes, axes))
    return Collective(kind, r.axes, nbytes, r.count, r.op, r.value, op.primitive, op.name, t, wire_bytes=sent)


def _combined(program: Program, kept: list[Reshard], collectives: list[Collective], axes: Mapping[str, int],
              topology: Topology, priced: dict) -> list[Collective]:
    """The collectives with the latency taken off those XLA combines into an earlier one of
    their group (see :mod:`automap.cost.combine`); each made once per (collective, group, pays
    its latency) in ``priced`` (:func:`_priced`'s entry: states share most collectives, and most
    keep their group from state to state)."""
    if not collectives:
        return collectives
    kinds = combined_kinds(topology)
    keys = combine_groups(program, kept)
    charged = latency_charges(keys, [c.bytes for c in collectives], kinds)
    out = []
    for c, pays, key in zip(collectives, charged, keys, strict=True):
        memo_key = ("combined", id(c), key, pays)  # c is one of priced's: this estimate's topology and mesh
        got = priced.get(memo_key)
        if got is None or got[0] is not c:
            new = c
            if c.kind in kinds:
                new = dataclasses.replace(new, combine_key=key)
            if not pays:
                latency = collective_time(c.kind, 0, c.axes, axes, topology) * c.count
                new = dataclasses.replace(new, time_s=new.time_s - latency, combined=True)
            got = priced[memo_key] = (c, new)  # c kept in the entry: its id is not reused while it lives
        out.append(got[1])
    return out


def _ops_by_id(program: Program) -> Mapping[int, Op]:
    got = program.memo.get("ops_by_id")
    if got is None:
        got = program.memo["ops_by_id"] = {op.id: op for op in program.all_ops}
    return got


_PRICED: dict[tuple, tuple] = {}


def _priced(topology: Topology, state: ShardingState) -> dict[int, tuple]:
    """id(reshard) -> (reshard, its :class:`Collective` or None), and the combined collectives
    (:func:`_combined`), for one topology and mesh: the same reshard objects recur from state to state (the topology, and each reshard, are kept in
    the entries, so that their ids are not reused while the entries live)."""
    key = (id(topology), state.mesh_key)
    got = _PRICED.get(key)
    if got is None or got[0] is not topology:
        if len(_PRICED) > 16:
            _PRICED.clear()
        got = _PRICED[key] = (topology, {})
    elif len(got[1]) > 200_000:
        got[1].clear()
    return got[1]


def _is_real_dot(program, op, fax, axes) -> bool:
    """A contraction (by its traits) that stays one in XLA: a convolution, or a matmul whose
    per-device contraction has size > 1 (XLA rewrites a dot with a size-1 contraction, an outer
    product such as a weight gradient with one example per device, into a multiply). A blocked
    factor in no result is contracted whole (a ragged dot's weight gradient sums over its rows)."""
    traits = traits_of(op.primitive)
    if traits.contraction is None:
        return False
    if not traits.matmul:
        return True
    rule = op.rule
    contraction = 1
    for f in _contracted_factors(rule):
        contraction *= rule.factors[f].size // math.prod(axes[a] for a in fax.get(f, ()))
    return contraction > 1


@functools.lru_cache(maxsize=4096)
def _contracted_factors(rule) -> tuple[int, ...]:
    """The reduction factors and the blocked factors of no result."""
    shown = {f for dims in rule.results for fs in dims for f in fs}
    return tuple(i for i, f in enumerate(rule.factors)
                 if f.kind == "reduction" or (f.kind == "blocked" and i not in shown))
