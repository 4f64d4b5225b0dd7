"""Fidelity: the compiled program (measured by XLA) held against the plan's estimate.

``plan.verify(compiled)`` (or ``train_step.verify(*args)``, which compiles what ``__call__``
runs) returns a :class:`Fidelity`: bytes sent per device (``wire_bytes`` on both sides), memory
per device and dot FLOPs, estimated and measured, and the collectives per kind and mesh axes.
Its ``str`` is a table that names where the two disagree: the ops the plan expected a collective
at that XLA did not emit one for, and what XLA emitted that the plan did not expect (named by
the HLO's ``op_name`` metadata), and, op by op (:class:`OpRow`: emission replays each op in a
name scope carrying its id, :func:`automap.emit.op_scope`), where XLA's collectives differ from
the plan's. Figures off by more than the targets (bytes sent 10%, memory
25%, FLOPs 5%; :data:`TOLERANCES`) warn with a :class:`FidelityWarning`.

Collectives are attributed to mesh axes from their replica groups (the mesh axes along which the
devices of one group differ). XLA combines collectives of one kind into one (a tuple
all-reduce), so counts differ more often than bytes do; the bytes are what the targets hold.
"""
from __future__ import annotations

import collections
import dataclasses
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from automap.measure import KINDS, CollectiveOp, Measurement, measure
from automap.report import human_bytes
from automap.sub_axes import whole_axis

__all__ = ["Fidelity", "FidelityWarning", "Figure", "CollectiveRow", "OpRow", "TOLERANCES", "verify", "op_axes"]

TOLERANCES: Mapping[str, float] = {"bytes sent": 0.10, "memory": 0.25, "dot FLOPs": 0.05}


class FidelityWarning(UserWarning):
    """The compiled program differs from the plan's estimate by more than :data:`TOLERANCES`."""


@dataclasses.dataclass(frozen=True)
class Figure:
    """One per-device figure: the cost model's estimate and XLA's measure."""

    name: str
    estimated: float
    measured: float | None  # None: XLA did not report it (memory of a program given as text)
    tolerance: float

    @property
    def ratio(self) -> float | None:
        """measured / estimated (1.0 when both are 0, inf when only the estimate is 0)."""
        if self.measured is None:
            return None
        if self.estimated == 0:
            return 1.0 if self.measured == 0 else float("inf")
        return self.measured / self.estimated

    @property
    def within(self) -> bool:
        r = self.ratio
        return r is None or abs(r - 1) <= self.tolerance


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """Collectives of one kind over one set of mesh axes: estimated and measured (bytes sent
    per device per step, all executions), with where each side has them."""

    kind: str
    axes: tuple[str, ...]
    estimated_count: int
    estimated_bytes: float
    measured_count: int
    measured_bytes: float
    expected_at: tuple[str, ...]  # the plan's ops that imply them
    emitted_at: tuple[str, ...]  # the HLO's op_name metadata of XLA's collectives

    @property
    def ratio(self) -> float | None:
        if self.estimated_bytes == 0:
            return None
        return self.measured_bytes / self.estimated_bytes


@dataclasses.dataclass(frozen=True)
class OpRow:
    """The collectives at one of the plan's ops: the cost model's and those XLA emitted there
    (attributed by the ``#id`` that emission writes into the HLO's ``op_name`` metadata; XLA
    combines collectives of one kind into one, which then carries one op's name)."""

    op: int
    label: str  # "dot_general at GPT/blocks_0/attn"
    estimated: tuple[tuple[str, tuple[str, ...]], ...]  # (kind, axes), one per collective
    estimated_bytes: float
    measured: tuple[tuple[str, tuple[str, ...]], ...]
    measured_bytes: float

    @property
    def differs(self) -> bool:
        """Other kinds or axes, or bytes sent off by more than the bytes target."""
        if sorted(set(self.estimated)) != sorted(set(self.measured)):
            return True
        return abs(self.measured_bytes - self.estimated_bytes) > TOLERANCES["bytes sent"] * max(
            self.estimated_bytes, self.measured_bytes)

    def __str__(self) -> str:
        return (f"#{self.op} {self.label}: plan {_kinds(self.estimated)} {human_bytes(self.estimated_bytes)}; "
                f"XLA {_kinds(self.measured)} {human_bytes(self.measured_bytes)}")


def _kinds(kinds: Sequence[tuple[str, tuple[str, ...]]]) -> str:
    if not kinds:
        return "none"
    counts = collections.Counter(f"{k} over {'+'.join(a) or '-'}" for k, a in kinds)
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in sorted(counts.items()))


@dataclasses.dataclass(frozen=True)
class Fidelity:
    """The compiled program's measure against the plan's estimate (all figures per device)."""

    bytes_sent: Figure
    memory: Figure
    dot_flops: Figure
    collectives: tuple[CollectiveRow, ...]
    measurement: Measurement
    ops: tuple[OpRow, ...] = ()  # per plan op with collectives on either side, largest gap first
    unattributed_bytes: float = 0.0  # bytes sent by collectives whose metadata names no plan op

    def differing_ops(self) -> tuple[OpRow, ...]:
        """The ops where XLA's collectives differ from the plan's (:attr:`OpRow.differs`)."""
        return tuple(r for r in self.ops if r.differs)

    @property
    def figures(self) -> tuple[Figure, ...]:
        return self.bytes_sent, self.memory, self.dot_flops

    @property
    def ok(self) -> bool:
        """Every figure within its tolerance."""
        return all(f.within for f in self.figures)

    def problems(self) -> list[str]:
        """One line per figure outside its tolerance."""
        return [f"{f.name} measured {f.ratio:.2f}x the estimate (target within {f.tolerance:.0%})"
                for f in self.figures if not f.within]

    def __str__(self) -> str:
        lines = ["fidelity: estimated = the plan's cost model; measured = XLA's compiled program (per device)",
                 f"  {'':<16}{'estimated':>12}{'measured':>12}{'ratio':>8}"]
        for f in self.figures:
            fmt = _count if f.name == "dot FLOPs" else human_bytes
            got = "-" if f.measured is None else fmt(f.measured)
            ratio = "-" if f.ratio is None else f"{f.ratio:.2f}"
            flag = "" if f.within else f"  off by more than {f.tolerance:.0%}"
            lines.append(f"  {f.name:<16}{fmt(f.estimated):>12}{got:>12}{ratio:>8}{flag}")
        if self.collectives:
            lines.append(f"  {'collective':<20}{'axes':<12}{'est n':>6}{'est sent':>11}{'XLA n':>7}"
                         f"{'XLA sent':>11}{'ratio':>7}")
        for r in self.collectives:
            ratio = "-" if r.ratio is None else f"{r.ratio:.2f}"
            lines.append(f"  {r.kind:<20}{'+'.join(r.axes) or '-':<12}{r.estimated_count:>6}"
                         f"{human_bytes(r.estimated_bytes):>11}{r.measured_count:>7}"
                         f"{human_bytes(r.measured_bytes):>11}{ratio:>7}")
            if r.estimated_count and not r.measured_count:
                lines.append(f"      expected by the plan, not emitted by XLA: {_listing(r.expected_at)}")
            elif r.measured_count and not r.estimated_count:
                lines.append(f"      emitted by XLA, not expected by the plan: {_listing(r.emitted_at)}")
            elif r.ratio is not None and abs(r.ratio - 1) > TOLERANCES["bytes sent"]:
                lines.append(f"      plan: {_listing(r.expected_at)}; XLA: {_listing(r.emitted_at)}")
        differing = self.differing_ops()
        if differing:
            lines.append(f"  ops where XLA's collectives differ from the plan's ({len(differing)}, largest first):")
            lines.extend(f"    {r}" for r in differing[:8])
            if len(differing) > 8:
                lines.append(f"    and {len(differing) - 8} more (Fidelity.differing_ops())")
        if self.unattributed_bytes:
            lines.append(f"  XLA collectives naming no op of the plan: {human_bytes(self.unattributed_bytes)} sent")
        return "\n".join(lines)


def _count(n: float) -> str:
    return f"{n:.3g}"


def _listing(names: Sequence[str], limit: int = 4) -> str:
    counts = collections.Counter(names)
    shown = [f"{n} x{c}" if c > 1 else n for n, c in counts.most_common(limit)]
    more = len(counts) - len(shown)
    return ", ".join(shown) + (f", and {more} more" if more > 0 else "")


def op_axes(op: CollectiveOp, mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes a collective runs over: those along which the devices of one of its
    replica groups (or a permute's source and target) differ. Device ids are positions in the
    mesh's flattened device order (the partition ids of an SPMD program).

    >>> from automap.measure import CollectiveOp
    >>> op = CollectiveOp("all-reduce", 64, 1, [[0, 4], [1, 5], [2, 6], [3, 7]], "ar", "main")
    >>> op_axes(op, {"data": 2, "model": 4})
    ('data',)
    """
    names, shape = list(mesh_shape), tuple(mesh_shape.values())
    n = int(np.prod(shape))
    if op.replica_groups:
        groups = op.replica_groups
    elif op.source_target_pairs:
        groups = op.source_target_pairs
    else:  # one group of every device
        groups = [list(range(n))]
    varying: set[int] = set()
    for group in groups:
        ids = [d for d in group if 0 <= d < n]
        if len(ids) < 2:
            continue
        coords = np.array(np.unravel_index(ids, shape)).T
        varying.update(int(i) for i in np.flatnonzero((coords != coords[0]).any(axis=0)))
    return tuple(names[i] for i in sorted(varying))


def _in_mesh_order(axes: Sequence[str], mesh_shape: Mapping[str, int]) -> tuple[str, ...]:
    """The mesh axes of an estimated collective, a sub-axis as its whole axis (the axis along which
    its devices differ, as :func:`op_axes` names XLA's)."""
    order = list(mesh_shape)
    whole = {whole_axis(a) for a in axes}
    return tuple(sorted((a for a in whole if mesh_shape.get(a, 1) > 1), key=order.index))


def _op_label(metadata: str | None, fallback: str) -> str:
    if metadata and 'op_name="' in metadata:
        return metadata.split('op_name="', 1)[1].split('"', 1)[0]
    return fallback


def _plan_label(plan: Any, op_name: str) -> str:
    """The plan's ops an HLO ``op_name`` names (``dot_general at GPT/head``), else ``op_name``."""
    from automap.emit import ops_of_metadata

    ops = {o.id: o for o in plan.program.all_ops}
    named = [ops[i] for i in ops_of_metadata(op_name) if i in ops]
    if not named:
        return op_name
    return " + ".join(f"{o.primitive} at {o.name}" if o.name else o.primitive for o in named)


def compare(plan: Any, measured: Measurement, labels: Mapping[str, str] | None = None) -> Fidelity:
    """The :class:`Fidelity` of ``measured`` (XLA's measure of the plan's compiled program)."""
    est = plan.estimate
    mesh_shape = {str(k): int(v) for k, v in plan.mesh.shape.items()}
    rows: dict[tuple[str, tuple[str, ...]], dict[str, Any]] = {}

    def row(kind: str, axes: tuple[str, ...]) -> dict[str, Any]:
        return rows.setdefault((kind, axes), dict(ec=0, eb=0.0, mc=0, mb=0.0, at=[], xla=[]))

    for c in est.collectives:
        r = row(c.kind, _in_mesh_order(c.axes, mesh_shape))
        r["ec"] += c.count
        r["eb"] += c.wire_bytes
        r["at"].append(f"{c.primitive} at {c.module}" if c.module else c.primitive)
    for op in measured.ops:
        r = row(op.kind, op_axes(op, mesh_shape))
        r["mc"] += op.count_multiplier
        r["mb"] += op.wire_bytes
        r["xla"].append(_plan_label(plan, (labels or {}).get(op.name, op.name)))
    by_op, unattributed = _by_op(plan, est.collectives, measured, labels or {}, mesh_shape)
    ordered = sorted(rows.items(), key=lambda kv: (KINDS.index(kv[0][0]), len(kv[0][1]), kv[0][1]))
    table = tuple(CollectiveRow(kind, axes, r["ec"], r["eb"], r["mc"], r["mb"], tuple(r["at"]), tuple(r["xla"]))
                  for (kind, axes), r in ordered)
    return Fidelity(
        Figure("bytes sent", est.wire_bytes, measured.wire_bytes, TOLERANCES["bytes sent"]),
        Figure("memory", est.peak_memory_bytes, measured.memory_per_device, TOLERANCES["memory"]),
        Figure("dot FLOPs", est.dot_flops, measured.dot_flops, TOLERANCES["dot FLOPs"]),
        table, measured, by_op, unattributed,
    )


def _by_op(plan: Any, estimated: Sequence[Any], measured: Measurement, labels: Mapping[str, str],
           mesh_shape: Mapping[str, int]) -> tuple[tuple[OpRow, ...], float]:
    """Per plan op: the estimated collectives and XLA's (by the op id in their metadata)."""
    from automap.emit import ops_of_metadata

    ops = {op.id: op for op in plan.program.all_ops}
    rows: dict[int, dict[str, Any]] = {}
    unattributed = 0.0

    def row(i: int) -> dict[str, Any]:
        return rows.setdefault(i, dict(est=[], eb=0.0, got=[], mb=0.0))

    for c in estimated:
        r = row(c.op)
        r["est"].append((c.kind, _in_mesh_order(c.axes, mesh_shape)))
        r["eb"] += c.wire_bytes
    for m in measured.ops:
        ids = [i for i in ops_of_metadata(labels.get(m.name, "")) if i in ops]
        if not ids:
            unattributed += m.wire_bytes
            continue
        # a collective XLA combined from several: its bytes shared in proportion to the estimate's
        weights = [sum(c.wire_bytes for c in estimated if c.op == i and c.kind == m.kind) for i in ids]
        total = sum(weights)
        for i, weight in zip(ids, weights, strict=True):
            r = row(i)
            r["got"].append((m.kind, op_axes(m, mesh_shape)))
            r["mb"] += m.wire_bytes * (weight / total if total else 1 / len(ids))
    out = [OpRow(i, f"{ops[i].primitive} at {ops[i].name}" if ops[i].name else ops[i].primitive,
                 tuple(r["est"]), r["eb"], tuple(r["got"]), r["mb"]) for i, r in rows.items()]
    out.sort(key=lambda r: -abs(r.measured_bytes - r.estimated_bytes))
    return tuple(out), unattributed


def verify(plan: Any, compiled: Any, *, warn: bool = True) -> Fidelity:
    """Measure ``compiled`` (a ``jax.stages.Compiled`` of the plan's program, or its HLO text)
    and compare it with ``plan.estimate``; warn (:class:`FidelityWarning`) where a figure is off
    by more than :data:`TOLERANCES`.

    >>> import os; os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    >>> import jax.numpy as jnp, automap
    >>> step = automap.partition(lambda w, x: (x @ w).sum(), mesh=automap.make_mesh({"data": 2}), search=None)
    >>> w, x = jnp.ones((4, 2)), jnp.ones((8, 4))
    >>> print(verify(step.plan(w, x), step.lower(w, x).compile()))
    fidelity: estimated = the plan's cost model; measured = XLA's compiled program (per device)
                         estimated    measured   ratio
      bytes sent              20 B        20 B    1.00
      memory                 148 B       180 B    1.22
      dot FLOPs                 64          64    1.00
      collective          axes         est n   est sent  XLA n   XLA sent  ratio
      all-reduce          data             1        4 B      1        4 B   1.00
      all-gather          data             1       16 B      1       16 B   1.00
    """
    measured = measure(compiled)
    labels = _labels(compiled)
    fid = compare(plan, measured, labels)
    if warn and not fid.ok:
        warnings.warn("the compiled program differs from the plan's estimate: " + "; ".join(fid.problems())
                      + " (print(plan.verify(compiled)) for the table)", FidelityWarning, stacklevel=2)
    return fid


def _labels(compiled: Any) -> dict[str, str]:
    """HLO instruction name -> its ``op_name`` metadata (the jaxpr name stack and primitive)."""
    from automap import hlo

    text = compiled if isinstance(compiled, str) else compiled.as_text()
    module = hlo.parse_module(text)
    return {inst.name: _op_label(inst.attrs.get("metadata"), inst.name)
            for comp in module.computations.values() for inst in comp.instructions.values()
            if "metadata" in inst.attrs}
