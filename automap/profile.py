"""Symbolic profiler: FLOPs, bytes and memory of the *unpartitioned* program from shapes alone.

``profile(fn, *args)`` traces ``fn`` abstractly (:func:`automap.trace.trace`), lowers it
(:func:`automap.ir.lower.lower`) and reads every op's cost off the shapes
(:mod:`automap.cost.flops`, :mod:`automap.cost.memory`). Nothing is compiled or run, and with
``jax.ShapeDtypeStruct`` arguments no device memory is allocated, so a model far larger than the
host can be profiled in the time it takes to trace it (MAP/Colossal-Auto's symbolic profiler).

Costs are global (one device runs everything). ``bytes`` are what each op reads and writes once
XLA has fused elementwise chains (`automap.cost.flops.fused_op_bytes`): a value passed between
fusible ops only is not counted. Ops inside a ``scan`` body count once per trip.

**Memory categories.** Inputs are classified by structure first, path names only breaking ties:

====================  =========================  ==================
returned updated       read by the forward pass   category
====================  =========================  ==================
yes                    yes                        ``params``
yes                    no (optimizer only)        ``optimizer_state``
no                     --                         ``data``
====================  =========================  ==================

"Returned updated" means an output has the input's pytree structure, shapes and dtypes
(:func:`automap.trace.feedback_pairs`: ``state`` in, ``state`` out). Names decide when structure
cannot: in a program without a backward pass (no forward/optimizer split), for a state leaf no op
reads, and for inputs *not* returned (``loss_fn(params, batch)`` profiled alone). There a path with
an optimizer component (``opt_state``, or optax's ``mu``, ``nu``, ``count``, ...) is
``optimizer_state`` and one with a ``params`` component is ``params`` (the leftmost such component
decides: ``opt_state/mu/params/w`` is optimizer state), and the rest of the returned
leaves are ``params`` while the rest of the non-returned ones are ``data``.

Of the intermediates, ``activations`` are the forward-phase values that exist as buffers
(:func:`automap.cost.memory.materialized`) and are read by backward-phase ops: the residuals the
backward pass keeps (a scan's stacked residuals count in full). ``gradients`` are backward-phase
values read by optimizer-phase ops. ``peak`` is :func:`automap.cost.memory.estimate_memory` of the
replicated program (arguments + outputs - aliased + live temporaries) on the platform
:meth:`Profile.estimate` assumes by default (``cpu-sim``: XLA:CPU's own buffers included).
"""
from __future__ import annotations

import collections
import dataclasses
import gc
import math
from typing import Any, Callable, Mapping, Sequence

from automap.cost.estimate import Estimate, estimate as _estimate
from automap.cost.flops import dot_flops, fused_op_bytes, op_flops
from automap.cost.memory import MemoryEstimate, estimate_memory, materialized
from automap.cost.topology import Topology
from automap.ir.lower import lower
from automap.ir.program import Op, Program
from automap.shardings import ShardingState
from automap.trace import feedback_pairs, trace

CATEGORIES = ("params", "optimizer_state", "data")
# path components that mark optimizer state (optax state field names and the usual containers)
OPTIMIZER_NAMES = frozenset({
    "opt_state", "optimizer_state", "opt", "mu", "nu", "count", "momentum", "trace", "ema", "exp_avg",
    "exp_avg_sq", "accumulator", "step",
})
PARAM_NAMES = frozenset({"params", "param", "parameters", "weights", "variables"})


@dataclasses.dataclass(frozen=True)
class OpRow:
    """One op; ``flops``/``dot_flops``/``bytes``/``out_bytes`` are totals over its ``count``
    executions (``count``: the product of the trip counts of the scans around it)."""

    op: int
    primitive: str
    module: str
    phase: str
    flops: int
    dot_flops: int
    bytes: int
    out_bytes: int
    count: int


@dataclasses.dataclass(frozen=True)
class ModuleRow:
    """The ops of one module path truncated to ``depth`` components (``''``: outside any module)."""

    module: str
    flops: int
    dot_flops: int
    bytes: int
    ops: int


@dataclasses.dataclass(frozen=True)
class InputRow:
    """One input leaf: its pytree path (``state/params/head/kernel``), category and size."""

    path: str
    category: str  # one of CATEGORIES
    bytes: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Totals:
    """Whole-program sums of the op rows (``bytes_accessed``: what the ops read and write once
    elementwise chains are fused, `automap.cost.flops.fused_op_bytes`)."""

    flops: int
    dot_flops: int
    bytes_accessed: int


@dataclasses.dataclass(frozen=True)
class Profile:
    """What :func:`profile` found (see the module docstring for the memory categories)."""

    ops: tuple[OpRow, ...]
    modules: tuple[ModuleRow, ...]  # sorted by FLOPs, largest first
    totals: Totals
    memory: Mapping[str, int]  # params, optimizer_state, data, activations, gradients, peak
    inputs: tuple[InputRow, ...]
    peak: MemoryEstimate
    program: Program = dataclasses.field(repr=False, compare=False)
    donated: tuple[int, ...] = ()

    def by_module(self, depth: int) -> tuple[ModuleRow, ...]:
        """Per-module rows at another depth (``depth=1``: ``'GPT'``, 3: ``'GPT/blocks_0/attn'``)."""
        return _modules(self.ops, depth)

    def estimate(self, topology: Topology | None = None) -> Estimate:
        """The cost model's :class:`~automap.cost.Estimate` of the program on one device.

        >>> import jax, jax.numpy as jnp
        >>> p = profile(lambda x, w: x @ w, jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...             jax.ShapeDtypeStruct((4, 2), jnp.float32))
        >>> p.estimate().dot_flops
        128.0
        """
        return _estimate(ShardingState.initial(self.program, {}), topology, donated=self.donated)

    def table(self, top: int = 20) -> str:
        """Top modules and ops by FLOPs, then the memory breakdown, as text.

        >>> import jax, jax.numpy as jnp
        >>> p = profile(lambda x, w: x @ w, jax.ShapeDtypeStruct((8, 4), jnp.float32),
        ...             jax.ShapeDtypeStruct((4, 2), jnp.float32))
        >>> print(p.table().splitlines()[0])
        total 128 FLOP (128 FLOP in dots), 224 B accessed (fused), 1 ops
        """
        t = self.totals
        share = lambda f: f"{100 * f / t.flops:5.1f}%" if t.flops else "    -"  # noqa: E731
        phases: dict[str, int] = collections.Counter()
        for r in self.ops:
            phases[r.phase] += r.flops
        lines = [
            f"total {fmt_flops(t.flops)} ({fmt_flops(t.dot_flops)} in dots), "
            f"{fmt_bytes(t.bytes_accessed)} accessed (fused), {len(self.ops)} ops",
            "by phase: " + ", ".join(f"{k} {fmt_flops(v)}" for k, v in phases.items()),
            "",
            f"{'module':<40} {'FLOPs':>11} {'share':>6} {'dot FLOPs':>11} {'bytes':>10} {'ops':>6}",
        ]
        for m in self.modules[:top]:
            lines.append(
                f"{_clip(m.module or '(no module)', 40):<40} {fmt_flops(m.flops):>11} {share(m.flops):>6} "
                f"{fmt_flops(m.dot_flops):>11} {fmt_bytes(m.bytes):>10} {m.ops:>6}"
            )
        lines += ["", f"{'op':<16} {'module':<36} {'phase':<9} {'count':>5} {'FLOPs':>11} {'share':>6} "
                      f"{'bytes':>10} {'out':>10}"]
        for r in sorted(self.ops, key=lambda r: (-r.flops, r.op))[:top]:
            lines.append(
                f"{_clip(r.primitive, 16):<16} {_clip(r.module or '(no module)', 36):<36} {r.phase:<9} "
                f"{r.count:>5} {fmt_flops(r.flops):>11} {share(r.flops):>6} {fmt_bytes(r.bytes):>10} "
                f"{fmt_bytes(r.out_bytes):>10}"
            )
        lines += ["", "memory (unpartitioned)"]
        counts = collections.Counter(r.category for r in self.inputs)
        for key, value in self.memory.items():
            note = f"  {counts[key]} input leaves" if key in CATEGORIES else ""
            if key == "peak":
                e = self.peak
                note = (f"  = arguments {fmt_bytes(e.arguments)} + outputs {fmt_bytes(e.outputs)} - aliased "
                        f"{fmt_bytes(e.aliased)} + temporaries {fmt_bytes(e.temp)}")
            lines.append(f"  {key:<16} {fmt_bytes(value):>10}{note}")
        return "\n".join(lines)


def profile(
    fn: Callable,
    *args: Any,
    static_argnums: Sequence[int] = (),
    donate_argnums: Sequence[int] = (),
    depth: int = 2,
) -> Profile:
    """Profile ``fn(*args)`` symbolically (nothing is compiled or run).

    ``args`` may be arrays or ``jax.ShapeDtypeStruct`` pytrees; ``donate_argnums`` (indices into
    ``args``) lets outputs reuse donated input buffers in ``memory['peak']``; ``depth`` truncates
    module paths for :attr:`Profile.modules`. Python's garbage collector is paused while it runs.

    >>> import jax, jax.numpy as jnp
    >>> def step(params, x):
    ...     loss, g = jax.value_and_grad(lambda p: jnp.sum(jnp.tanh(x @ p["w"])))(params)
    ...     return {"w": params["w"] - 0.1 * g["w"]}, loss
    >>> f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    >>> p = profile(step, {"w": f32(4, 2)}, f32(8, 4))
    >>> p.totals.dot_flops  # forward x @ w (2*8*4*2) and the weight gradient x.T @ dy
    256
    >>> p.memory["params"], p.memory["data"], p.memory["gradients"]
    (32, 128, 32)
    """
    was_enabled = gc.isenabled()
    gc.disable()  # tracing builds a large object graph: collecting it while it grows costs ~25%
    try:
        return _profile(fn, args, static_argnums, donate_argnums, depth)
    finally:
        if was_enabled:
            gc.enable()


def _profile(fn: Callable, args: Sequence[Any], static_argnums: Sequence[int], donate_argnums: Sequence[int],
             depth: int) -> Profile:
    traced = trace(fn, args, static_argnums=static_argnums)
    program = lower(traced.closed_jaxpr, traced.in_paths, traced.out_paths)
    walked = list(program.walk())
    size = [math.prod(v.shape) * v.itemsize for v in program.values]  # Value.nbytes, cached
    rows = tuple(
        OpRow(
            op.id, op.primitive, op.name, op.phase, op_flops(program, op) * n, dot_flops(program, op) * n,
            nbytes * n, sum(size[v] for v in op.outputs) * n, n,
        )
        for (op, n), nbytes in zip(walked, fused_op_bytes(program), strict=True)
    )
    totals = Totals(sum(r.flops for r in rows), sum(r.dot_flops for r in rows), sum(r.bytes for r in rows))
    categories = _categorise(program, [op for op, _ in walked], set(feedback_pairs(traced).values()))
    inputs = tuple(
        InputRow(path, categories[i], size[v], program.values[v].shape)
        for i, (path, v) in enumerate(zip(program.input_paths, program.inputs, strict=True))
    )
    static = set(static_argnums)
    dynamic = [i for i in range(len(args)) if i not in static]
    donated_args = {dynamic.index(i) for i in donate_argnums if i in dynamic}
    donated = tuple(v for v, a in zip(program.inputs, traced.leaf_arg, strict=True) if a in donated_args)
    # replicated: nothing reshards (saves estimate_memory deriving that from the factor rules)
    peak = estimate_memory(ShardingState.initial(program, {}), donated=donated, reshards=(),
                           platform=Topology.preset("cpu-sim").platform)
    memory = {c: sum(r.bytes for r in inputs if r.category == c) for c in CATEGORIES}
    memory.update(_intermediates(program, walked, size))
    memory["peak"] = peak.peak
    return Profile(rows, _modules(rows, depth), totals, memory, inputs, peak, program, donated)


def _by_name(path: str) -> str | None:
    """The category the leftmost telling path component names (``opt_state/mu/params/w``: optimizer)."""
    for part in path.split("/"):
        if part in OPTIMIZER_NAMES:
            return "optimizer_state"
        if part in PARAM_NAMES:
            return "params"
    return None


def _categorise(program: Program, ops: Sequence[Op], updated: set[int]) -> list[str]:
    """One category per input leaf (the rules are in the module docstring)."""
    has_backward = any(op.phase == "backward" for op in ops)
    forward_read: set[int] = set()
    any_read: set[int] = set()
    for op in ops:
        any_read.update(op.inputs)
        if op.phase == "forward":
            forward_read.update(op.inputs)
    out = []
    for i, (path, vid) in enumerate(zip(program.input_paths, program.inputs, strict=True)):
        by_name = _by_name(path)
        if i not in updated:
            out.append(by_name or "data")
        elif has_backward and vid in any_read:
            out.append("params" if vid in forward_read else "optimizer_state")
        else:
            out.append(by_name or "params")
    return out


def _intermediates(program: Program, walked: Sequence[tuple[Op, int]], size: Sequence[int]) -> dict[str, int]:
    """Bytes of forward residuals read by the backward pass and of gradients read by the optimizer."""
    buffers = materialized(program.ops, program.outputs)
    for op, _ in walked:
        for region in op.regions:
            buffers |= materialized(region.ops, region.outputs)
    saved: set[int] = set()
    grads: set[int] = set()
    for op, _ in walked:
        for v in op.inputs:
            value = program.values[v]
            if value.kind != "intermediate":
                continue
            if op.phase == "backward" and value.phase == "forward" and v in buffers:
                saved.add(v)
            elif op.phase == "optimizer" and value.phase == "backward":
                grads.add(v)
    return {
        "activations": sum(size[v] for v in saved),
        "gradients": sum(size[v] for v in grads),
    }


def _modules(rows: Sequence[OpRow], depth: int) -> tuple[ModuleRow, ...]:
    acc: dict[str, list[int]] = {}
    for r in rows:
        key = "/".join(r.module.split("/")[:depth]) if r.module else ""
        a = acc.setdefault(key, [0, 0, 0, 0])
        a[0] += r.flops
        a[1] += r.dot_flops
        a[2] += r.bytes
        a[3] += 1
    out = [ModuleRow(k, *v) for k, v in acc.items()]
    return tuple(sorted(out, key=lambda m: (-m.flops, m.module)))


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else "..." + s[len(s) - n + 3:]


def fmt_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``; binary units up to TiB.

    >>> fmt_bytes(100), fmt_bytes(3 * 2**30)
    ('100 B', '3.00 GiB')
    """
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def fmt_flops(n: float) -> str:
    """``2.5e12`` -> ``'2.50 TFLOP'``; decimal units.

    >>> fmt_flops(999), fmt_flops(2.5e12)
    ('999 FLOP', '2.50 TFLOP')
    """
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}FLOP"
    return f"{int(n)} FLOP"
