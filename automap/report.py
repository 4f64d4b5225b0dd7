"""``plan.report()``: a readable table of the plan, its implied collectives and its reasons."""
from __future__ import annotations

import collections
from typing import Any

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


def format_report(plan: Any) -> str:
    program, state = plan.program, plan.state
    mesh_desc = " x ".join(f"{k}={v}" for k, v in state.axes.items())
    n_dev = int(np.prod(list(state.axes.values())))
    rows = [("input", "shape", "dtype", "spec", "bytes/device", "why")]
    total_global = total_dev = 0
    for vid, path in zip(program.inputs, program.input_paths, strict=True):
        v = program.values[vid]
        spec = state.spec(vid)
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
        per_dev = state.bytes_per_device(vid)
        total_global += v.nbytes
        total_dev += per_dev
        rows.append((path, str(v.shape), _dtype_name(v.dtype), format_spec(spec), human_bytes(per_dev), why))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"automap plan on mesh {mesh_desc} ({n_dev} devices): {program.summary()}"]
    for r in rows:
        lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(r[:5], widths)) + "  " + r[5])
    lines.append(
        f"  inputs: {human_bytes(total_dev)} per device of {human_bytes(total_global)} in all "
        f"({total_global / max(total_dev, 1):.2f}x split)"
    )
    est = plan.estimate
    by_kind: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0, 0.0])
    for c in est.collectives:
        by_kind[c.kind][0] += c.count
        by_kind[c.kind][1] += c.bytes * c.count
        by_kind[c.kind][2] += c.time_s
    if by_kind:
        lines.append("  collectives implied per step (count, bytes per device, estimated time):")
        for kind in sorted(by_kind):
            count, nbytes, t = by_kind[kind]
            lines.append(f"    {kind:<15} {count:>5}  {human_bytes(nbytes):>10}  {t * 1e3:8.3f} ms")
    else:
        lines.append("  collectives implied per step: none")
    mem = est.memory
    lines.append(
        f"  estimate ({est_topology(plan)}): step {est.time_s * 1e3:.3f} ms = compute {est.compute_time_s * 1e3:.3f} ms"
        f" + communication {est.comm_time_s * 1e3:.3f} ms; {est.flops:.4g} FLOPs/device; peak memory "
        f"{human_bytes(mem.peak)}/device (arguments {human_bytes(mem.arguments)} + outputs "
        f"{human_bytes(mem.outputs)} - donated {human_bytes(mem.aliased)} + temporaries {human_bytes(mem.temp)})"
    )
    lines.append(f"  pinned intermediates: {len(plan.pins)}")
    lines += rules_lines(program)
    for note in plan.notes:
        lines.append(f"  note: {note}")
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
