"""Search on meshes of 3+ axes: the default plan against every assignment of the tactics to the
axes, and ``plan()`` time against the number of mesh axes (estimates only; nothing compiled).

    python benchmarks/search_axes.py [--parts ab] [--layers 12] [--d-model 1024]

(a) assignments: on mesh data=2 x fsdp=2 x model=2 (``--topology``, default the backend's), the
    default plan's estimated step time against every assignment of data_parallel / fsdp /
    megatron to the three axes (each tactic on any number of axes; applied data parallel first,
    then Megatron, then FSDP, as the presets do, and also in mesh order); ratio <= 1: as good or
    better than the best expert.
(b) axes: the default ``plan()`` time (tracing, lowering, search) on meshes of 16 devices with 2, 3
    and 4 axes (topology h100-2x8); target: 4 axes <= 2x the time of 2 axes.
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=16")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/ from shadowing the packages)

import automap  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402

TACTICS = {"data_parallel": tactics.data_parallel, "megatron": tactics.megatron, "fsdp": tactics.fsdp}
ORDER = ("data_parallel", "megatron", "fsdp")  # as the presets apply them


def workload(args):
    return zoo.gpt_linen(zoo.GPTConfig(layers=args.layers, d_model=args.d_model, heads=args.d_model // 64,
                                       vocab=2048, seq=128, batch=16, scan=args.scan))


def assignments(args) -> None:
    axes = {"data": 2, "fsdp": 2, "model": 2}
    mesh = automap.make_mesh(axes)
    w = workload(args)
    t0 = time.perf_counter()
    topology = automap.Topology.preset(args.topology) if args.topology else automap.cost.default_topology()
    default = automap.automap(w.train_step, mesh=mesh, topology=topology).plan(*w.abstract())
    took = time.perf_counter() - t0
    budget = topology.device.memory_bytes
    rows = []
    for combo in itertools.product(TACTICS, repeat=len(axes)):
        pairs = list(zip(combo, axes, strict=True))
        for order_name, ordered in (("preset order", sorted(pairs, key=lambda p: ORDER.index(p[0]))),
                                    ("mesh order", pairs)):
            schedule = [TACTICS[name](axis) for name, axis in ordered]
            plan = automap.automap(w.train_step, mesh=mesh, tactics=schedule, search=None,
                                   topology=topology).plan(*w.abstract())
            est = plan.estimate
            label = " + ".join(f"{n}({a})" for n, a in ordered)
            rows.append((est.time_s, est.peak_memory_bytes <= budget, label, order_name, est))
    fitting = [r for r in rows if r[1]]
    best = min(fitting, key=lambda r: r[0])
    d = default.estimate
    print(f"(a) {args.layers}-layer GPT d={args.d_model} on data=2 x fsdp=2 x model=2, topology {topology.name}: "
          f"default plan "
          f"{d.time_s * 1e3:.3f} ms (plan() {took:.1f} s); best of {len(fitting)} fitting expert assignments "
          f"{best[0] * 1e3:.3f} ms ({best[2]}); ratio default / best {d.time_s / best[0]:.3f} (target <= 1)")
    worse = [r for r in fitting if r[0] < d.time_s * (1 - 1e-9)]
    print(f"    assignments faster than the default: {len(worse)} of {len(fitting)}")
    for r in sorted(fitting, key=lambda r: r[0])[:5]:
        print(f"    {r[0] * 1e3:9.3f} ms  {r[2]}  ({r[3]})")
    print("    default plan: " + "; ".join(n for n in default.notes if n.startswith("search")))


def axis_scaling(args) -> None:
    meshes = {2: {"a": 4, "b": 4}, 3: {"a": 2, "b": 2, "c": 4}, 4: {"a": 2, "b": 2, "c": 2, "d": 2}}
    w = workload(args)
    times = {}
    for n, axes in meshes.items():
        if n > args.max_axes:
            continue
        t0 = time.perf_counter()
        plan = automap.automap(w.train_step, mesh=automap.make_mesh(axes), topology="h100-2x8").plan(*w.abstract())
        times[n] = time.perf_counter() - t0
        used = sorted({a for spec in plan.state.specs.values() for dim in spec for a in dim})
        print(f"(b) {n} axes {axes}: plan() {times[n]:6.1f} s, estimate {plan.estimate.time_s * 1e3:.3f} ms, "
              f"axes used {used}", flush=True)
    if 2 in times and 4 in times:
        print(f"    plan() time 4 axes / 2 axes = {times[4] / times[2]:.2f} (target <= 2)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="ab")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--scan", action="store_true")
    parser.add_argument("--max-axes", type=int, default=4)
    parser.add_argument("--topology", default=None, help="(a): a preset name (default: the backend's)")
    args = parser.parse_args()
    if "a" in args.parts:
        assignments(args)
    if "b" in args.parts:
        axis_scaling(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
