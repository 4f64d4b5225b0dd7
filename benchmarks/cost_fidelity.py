"""Cost-model fidelity: estimated vs XLA-measured collective bytes, memory and dot FLOPs.

For the zoo GPT (linen and nnx, scanned and unrolled) and the MLP, on meshes 8, 2x4 and 4x2, and
for each expert plan (data parallel, Megatron + data parallel, FSDP, FSDP + Megatron) and
automap's own plan, the plan is made by automap (the expert plans as manual rules on the
parameters and the batch), compiled, measured with ``automap.measure`` and compared with
``plan.estimate``. Prints one row per configuration and min/median/max ratios per plan family.

    python benchmarks/cost_fidelity.py [--quick] [--csv out.csv]

Targets: collective bytes within +-10%, memory per device within +-25%, dot FLOPs within +-5%.
Also reported, without a target: memory traffic (``plan.estimate.bytes_accessed``, elementwise
chains fused) against the ``bytes accessed`` of XLA's cost analysis of the compiled program.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)
import jax  # noqa: E402
from jax import tree_util  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402

GPT = dict(layers=2, d_model=64, heads=4, vocab=256, seq=16, batch=8)
MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2}}
TARGETS = {"collectives": 0.10, "memory": 0.25, "dot_flops": 0.05}


def workloads(quick: bool):
    out = {
        "gpt_linen": lambda: zoo.gpt_linen(zoo.GPTConfig(**GPT)),
        "gpt_linen_scan": lambda: zoo.gpt_linen(zoo.GPTConfig(scan=True, **GPT)),
        "gpt_nnx": lambda: zoo.gpt_nnx(zoo.GPTConfig(**GPT)),
        "gpt_nnx_scan": lambda: zoo.gpt_nnx(zoo.GPTConfig(scan=True, **GPT)),
        "mlp": lambda: zoo.mlp(zoo.MLPConfig(d_in=64, hidden=(256, 256), d_out=64, batch=8)),
    }
    return {k: out[k] for k in (["gpt_linen", "mlp"] if quick else out)}


def _is_spec(x):
    return isinstance(x, P)


def _rename(spec: P, old: str, new) -> P:
    return P(*[new if e == old else e for e in spec])


def _rules(state_specs, batch_specs):
    """Manual rules pinning every parameter and batch leaf to the expert spec."""
    rules = []
    for prefix, tree in (("state/params", state_specs["params"]), ("batch", batch_specs)):
        for path, spec in tree_util.tree_flatten_with_path(tree, is_leaf=_is_spec)[0]:
            rules.append(("^" + prefix + "/" + "/".join(str(k.key) for k in path) + "$", spec))
    return rules


def expert_plans(w, mesh_name: str, mesh):
    """Expert schedules for this mesh: {family: [tactics]}; every mesh axis is used."""
    state, batch = w.abstract()
    axes = tuple(mesh.shape)
    plans = {}
    all_axes = axes if len(axes) > 1 else axes[0]
    flat = jax.sharding.Mesh(mesh.devices.reshape(-1), ("data",))
    # data parallel / FSDP: the batch (and FSDP's parameter shards) over every mesh axis
    s, b = zoo.experts.data_parallel(state, batch, flat)
    plans["data_parallel"] = _rules(s, jax.tree.map(lambda p: _rename(p, "data", all_axes), b, is_leaf=_is_spec))
    s, b = zoo.experts.fsdp(state, batch, flat)
    rename = lambda t: jax.tree.map(lambda p: _rename(p, "data", all_axes), t, is_leaf=_is_spec)  # noqa: E731
    plans["fsdp"] = _rules(rename(s), rename(b))
    if len(axes) > 1:
        s, b = zoo.experts.megatron(state, batch, mesh)
        plans["megatron_dp"] = _rules(s, b)
        s, b = zoo.experts.fsdp_megatron(state, batch, mesh)
        plans["fsdp_megatron"] = _rules(s, b)
    else:
        model_mesh = jax.sharding.Mesh(mesh.devices.reshape(-1), ("model",))
        s, b = zoo.experts.megatron(state, batch, model_mesh, data=None)
        plans["megatron"] = [(p.replace("model", "data") if False else p, _rename(spec, "model", "data"))
                             for p, spec in _rules(s, b)]
    return {k: [tactics.manual(v)] for k, v in plans.items()} | {"automap": None}


def ratio(est: float, measured: float) -> float:
    if measured == 0:
        return 1.0 if est == 0 else float("inf")
    return est / measured


def run(quick: bool, csv_path: str | None) -> int:
    rows = []
    header = f"{'model':<15} {'mesh':<4} {'plan':<14} {'coll est':>10} {'coll xla':>10} {'ratio':>6} " \
             f"{'mem est':>10} {'mem xla':>10} {'ratio':>6} {'flop ratio':>10}"
    print(header)
    t0 = time.time()
    meshes = {"2x4": MESHES["2x4"]} if quick else MESHES
    for model_name, make in workloads(quick).items():
        w = make()
        state, batch = w.init(0)
        for mesh_name, axes in meshes.items():
            mesh = automap.make_mesh(axes)
            for family, schedule in expert_plans(w, mesh_name, mesh).items():
                step = automap.automap(w.train_step, mesh=mesh, tactics=schedule)
                plan = step.plan(state, batch)
                est = plan.estimate
                compiled = step.lower(state, batch).compile()
                m = automap.measure(compiled)
                cost = compiled.cost_analysis()
                cost = cost[0] if isinstance(cost, (list, tuple)) else cost
                row = dict(
                    model=model_name, mesh=mesh_name, plan=family,
                    coll_est=est.collective_bytes, coll_xla=m.collective_bytes,
                    mem_est=est.peak_memory_bytes, mem_xla=m.memory_per_device,
                    flops_est=est.dot_flops, flops_xla=m.dot_flops,
                    traffic_est=est.bytes_accessed, traffic_xla=cost.get("bytes accessed", 0.0),
                )
                row["coll_ratio"] = ratio(row["coll_est"], row["coll_xla"])
                row["mem_ratio"] = ratio(row["mem_est"], row["mem_xla"])
                row["flop_ratio"] = ratio(row["flops_est"], row["flops_xla"])
                row["traffic_ratio"] = ratio(row["traffic_est"], row["traffic_xla"])
                rows.append(row)
                print(f"{model_name:<15} {mesh_name:<4} {family:<14} {row['coll_est']:>10} {row['coll_xla']:>10} "
                      f"{row['coll_ratio']:>6.3f} {row['mem_est']:>10} {row['mem_xla']:>10} {row['mem_ratio']:>6.3f} "
                      f"{row['flop_ratio']:>10.3f}", flush=True)
    print(f"\n{len(rows)} configurations in {time.time() - t0:.0f} s. Ratios estimated / XLA (min / median / max):")
    failures = 0
    for family in sorted({r["plan"] for r in rows}):
        sel = [r for r in rows if r["plan"] == family]
        parts = []
        for key, target in (("coll_ratio", "collectives"), ("mem_ratio", "memory"), ("flop_ratio", "dot_flops")):
            vals = [r[key] for r in sel]
            tol = TARGETS[target]
            bad = sum(abs(v - 1) > tol for v in vals)
            failures += bad
            parts.append(f"{target} {min(vals):.3f}/{statistics.median(vals):.3f}/{max(vals):.3f}"
                         + (f" ({bad} outside +-{tol:.0%})" if bad else ""))
        traffic = [r["traffic_ratio"] for r in sel]
        parts.append(f"traffic {min(traffic):.3f}/{statistics.median(traffic):.3f}/{max(traffic):.3f}")
        print(f"  {family:<14} " + "  ".join(parts))
    if csv_path:
        import csv

        with open(csv_path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    print(f"{failures} ratios outside their target")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--csv")
    args = parser.parse_args()
    sys.exit(run(args.quick, args.csv))
