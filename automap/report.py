"""``plan.report()``: a readable account of the plan: what it costs, then a table of the inputs.

The table collapses what repeats so that a 48-layer model reads like a 1-layer one: optimizer
state that mirrors a parameter (same path suffix, shape, dtype and spec: Adam's ``mu``/``nu``)
is one line per state tree, and leaves of identical layers (paths that differ only in a layer
index, with the same shape, dtype, spec and reason) are one row ``blocks_{0..11}/...``.
``plan.report(full=True)`` lists every leaf.
"""
from __future__ import annotations

import collections
import dataclasses
import re
from typing import Any, Sequence

import numpy as np

from automap.shardings import format_spec


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def est_topology(plan: Any) -> str:
    from automap.cost import default_topology

    return (plan.topology or default_topology()).name


@dataclasses.dataclass(frozen=True)
class Row:
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: str
    per_device: int
    why: str

    @property
    def layout(self) -> tuple[Any, ...]:
        return self.shape, self.dtype, self.spec


def input_rows(plan: Any) -> list[Row]:
    """One :class:`Row` per input leaf: path, shape, dtype, spec, bytes per device, why."""
    program, state = plan.program, plan.state
    rows = []
    for vid, path in zip(program.inputs, program.input_paths, strict=True):
        v = program.values[vid]
        reasons = []
        for d in range(v.ndim):
            why = state.why(vid, d)
            if why and why not in reasons:
                reasons.append(why)
        if vid in plan.reasons:
            why = plan.reasons[vid]
        elif reasons:
            why = "propagated from " + "; ".join(reasons)
        else:
            why = "replicated"
        rows.append(Row(path, v.shape, _dtype_name(v.dtype), format_spec(state.spec(vid)),
                        state.bytes_per_device(vid), why))
    return rows


def _mirrors(rows: Sequence[Row]) -> dict[int, str]:
    """Row index -> the prefix of its state tree, for rows that mirror a parameter: another,
    shorter path ending in the same last two or more components, with the same layout."""
    by_suffix: dict[tuple[str, ...], list[int]] = collections.defaultdict(list)
    parts = [r.path.split("/") for r in rows]
    for i, p in enumerate(parts):
        for k in range(2, len(p) + 1):
            by_suffix[tuple(p[-k:])].append(i)
    out: dict[int, str] = {}
    for i, p in enumerate(parts):
        for k in range(len(p) - 1, 1, -1):  # the longest shared suffix decides
            others = [j for j in by_suffix.get(tuple(p[-k:]), ()) if j != i and len(parts[j]) < len(p)]
            if others:
                if all(rows[j].layout == rows[i].layout for j in others):
                    out[i] = "/".join(p[:-k])
                break
    return out


_INDEX = re.compile(r"^(.*?)(\d+)$")


def _layer_key(path: str) -> tuple[str, tuple[int, ...]]:
    """``'blocks_3/attn/kernel'`` -> (``'blocks_{}/attn/kernel'``, (3,)): numbered components."""
    comps, idx = [], []
    for c in path.split("/"):
        m = _INDEX.match(c)
        if m and (m.group(1) == "" or m.group(1).endswith("_")):
            comps.append(m.group(1) + "{}")
            idx.append(int(m.group(2)))
        else:
            comps.append(c)
    return "/".join(comps), tuple(idx)


def _ranges(values: Sequence[int]) -> str:
    vs = sorted(set(values))
    if vs == list(range(vs[0], vs[-1] + 1)) and len(vs) > 2:
        return f"{vs[0]}..{vs[-1]}"
    return ",".join(map(str, vs))


def collapse(rows: Sequence[Row]) -> list[tuple[str, str, str, str, str, str]]:
    """The table's rows as text, with optimizer-state mirrors and identical layers folded."""
    mirrors = _mirrors(rows)
    out: list[tuple[str, str, str, str, str, str]] = []
    trees: dict[str, list[int]] = collections.defaultdict(list)
    for i, prefix in mirrors.items():
        trees[prefix].append(i)
    folded_into = {i: prefix for prefix, members in trees.items() for i in members if len(members) > 1}
    shown = [i for i in range(len(rows)) if i not in folded_into]
    groups: dict[str, list[int]] = collections.defaultdict(list)
    for i in shown:
        groups[_layer_key(rows[i].path)[0]].append(i)
    done: set[int] = set()
    emitted_trees: set[str] = set()
    for i in range(len(rows)):
        if i in folded_into:
            prefix = folded_into[i]
            if prefix not in emitted_trees:
                emitted_trees.add(prefix)
                members = trees[prefix]
                total = sum(rows[j].per_device for j in members)
                out.append((f"{prefix}/...", f"{len(members)} leaves", "", "", human_bytes(total),
                            "same specs as their parameters"))
            continue
        if i in done:
            continue
        key = _layer_key(rows[i].path)[0]
        members = groups[key]
        same = len(members) > 1 and all(
            rows[j].layout == rows[i].layout and rows[j].why == rows[i].why for j in members
        )
        if not same:
            members = [i]
        done.update(members)
        r = rows[i]
        path = r.path
        if len(members) > 1:
            indices = list(zip(*(_layer_key(rows[j].path)[1] for j in members), strict=True))
            path = key.format(*("{" + _ranges(ix) + "}" if len(set(ix)) > 1 else str(ix[0]) for ix in indices))
            per = f"{human_bytes(r.per_device)} x{len(members)}"
        else:
            per = human_bytes(r.per_device)
        out.append((path, str(r.shape), r.dtype, r.spec, per, r.why))
    return out


def format_report(plan: Any, full: bool = False) -> str:
    program, state = plan.program, plan.state
    mesh_desc = " x ".join(f"{k}={v}" for k, v in state.axes.items())
    n_dev = int(np.prod(list(state.axes.values())))
    lines = [f"automap plan on mesh {mesh_desc} ({n_dev} devices): {program.summary()}"]
    est = plan.estimate
    mem = est.memory
    lines.append(
        f"  estimate ({est_topology(plan)}; the cost model's, nothing compiled): step {est.time_s * 1e3:.3f} ms = compute {est.compute_time_s * 1e3:.3f} ms"
        f" + communication {est.comm_time_s * 1e3:.3f} ms; {est.flops:.4g} FLOPs/device; peak memory "
        f"{human_bytes(mem.peak)}/device (arguments {human_bytes(mem.arguments)} + outputs "
        f"{human_bytes(mem.outputs)} - donated {human_bytes(mem.aliased)} + temporaries {human_bytes(mem.temp)})"
    )
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for c in est.collectives:
        by_kind[c.kind][0] += c.count
        by_kind[c.kind][1] += c.bytes * c.count
        by_kind[c.kind][2] += c.time_s
    if by_kind:
        lines.append("  collectives implied per step (count, bytes per device, estimated time), one per resharded "
                     "value before XLA combines them (automap.measure(compiled) counts what XLA built):")
        for kind in sorted(by_kind):
            count, nbytes, t = by_kind[kind]
            lines.append(f"    {kind:<15} {count:>5}  {human_bytes(nbytes):>10}  {t * 1e3:8.3f} ms")
    else:
        lines.append("  collectives implied per step: none")
    rows = input_rows(plan)
    table = [(r.path, str(r.shape), r.dtype, r.spec, human_bytes(r.per_device), r.why) for r in rows] if full \
        else collapse(rows)
    table.insert(0, ("input", "shape", "dtype", "spec", "bytes/device", "why"))
    widths = [max(len(r[i]) for r in table) for i in range(5)]
    for r in table:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    total_global = sum(program.values[v].nbytes for v in program.inputs)
    total_dev = sum(r.per_device for r in rows)
    lines.append(
        f"  inputs: {human_bytes(total_dev)} per device of {human_bytes(total_global)} in all "
        f"({total_global / max(total_dev, 1):.2f}x split)"
        + ("" if full or len(table) - 1 == len(rows) else f"; {len(rows)} leaves in {len(table) - 1} rows "
           "(report(full=True) lists every leaf)")
    )
    lines.append(f"  pinned intermediates: {len(plan.pins)}")
    dropped = plan.state.program.dropped_remat
    if dropped:  # the search found the plan better without it (search/recompute.py: without_user_remat)
        lines.append(f"  the model's own remat dropped ({dropped} jax.checkpoint call(s)): the backward reads the "
                     "forward's values instead of recomputing them (keep_user_remat=True keeps it)")
    recomputed = plan.state.program.recomputed
    if recomputed:  # a memory budget no plan met otherwise (search/recompute.py)
        lines.append(f"  recomputed in the backward (activation checkpointing): {', '.join(recomputed)}")
    lines += rules_lines(program)
    for note in plan.notes:
        lines.append(f"  note: {note}")
    arbitration = getattr(plan, "measured", {}).get("arbitration")
    if arbitration is not None:
        lines.append(f"  measured (XLA): {arbitration.note()}")
    else:
        lines.append("  measured (XLA): not compiled yet; plan.verify(compiled) holds a compiled program against "
                     "the estimate")
    return "\n".join(lines)


def rules_lines(program: Any) -> list[str]:
    """Where the plan could not shard freely: ops replicated around (no rule), ops kept whole on
    purpose (with the reason) and primitives whose rule was derived from XLA."""
    from automap.rules import UNSHARDABLE, registry

    lines = []
    missing = sorted({op.primitive for op in program.all_ops if not op.has_rule})
    if missing:
        lines.append(f"  replicated around (no factor rule): {', '.join(missing)}")
    whole = {}
    for op in program.all_ops:
        if op.primitive in UNSHARDABLE:
            whole.setdefault(op.primitive, op.source)
    for prim, source in sorted(whole.items()):
        lines.append(f"  kept whole: {prim} at {source or '?'}: {UNSHARDABLE[prim]}")
    derived = sorted({op.primitive for op in program.all_ops
                      if op.has_rule and not op.regions and registry.is_derived(op.primitive)})
    if derived:
        lines.append(f"  factor rules derived from XLA (no hand-written rule): {', '.join(derived)}")
    return lines
