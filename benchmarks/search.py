"""Search benchmark: plan quality against expert plans, recovery over seeds, and scaling in depth.

    python benchmarks/search.py [--quick] [--episodes 48] [--topology h100-8]

(a) quality: for the zoo GPT (2 and 12 layers, unrolled and scanned) on meshes 8, 2x4 and 4x2,
    with no budget and with a budget that pure data parallelism does not fit, the estimated step
    time of the MCTS plan (no tactics) against the best expert plan that fits (the named plans
    and every composition of the tactics, one per mesh axis), against Greedy, and (2 layers)
    against the exact solver (ILP) on the same decision groups under the same expert ceiling;
    with ``--measure``, the XLA-compiled collectives and memory of the MCTS and expert plans.
(b) recovery: over 10 seeds on mesh 2x4, how often MCTS finds a plan at least as good as
    Megatron + data parallel (estimated).
(c) scaling: search time (excluding tracing) at 2, 12, 24 and 48 layers, scanned and unrolled.
(p) plan time: the whole default ``plan()`` of the 12-layer unrolled GPT (target <= 10 s).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

import automap  # noqa: E402
import search  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402
from automap.cost import Topology  # noqa: E402
from automap.shardings import ShardingState  # noqa: E402
from automap.trace import feedback_pairs  # noqa: E402
from tactics import PlanContext, run_schedule  # noqa: E402

MESHES = {"8": {"data": 8}, "2x4": {"data": 2, "model": 4}, "4x2": {"data": 4, "model": 2}}
SIZE = dict(d_model=256, heads=8, vocab=2048, seq=128, batch=16)


def setup(layers: int, scan: bool, axes: dict):
    w = zoo.gpt_linen(zoo.GPTConfig(layers=layers, scan=scan, **SIZE))
    t = automap.trace(w.train_step, w.abstract())
    p = automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)
    pairs = feedback_pairs(t)
    state_in = tuple(sorted({p.inputs[i] for i in pairs.values()}))
    data_in = tuple(v for v in p.inputs if v not in state_in)
    return w, p, PlanContext(p, axes, data_in, state_in), ShardingState.initial(p, axes)


def experts(axes: dict):
    names = list(axes)
    if len(names) == 1:
        d = names[0]
        return {"data_parallel": [tactics.data_parallel(d)], "megatron": [tactics.megatron(d)],
                "fsdp": [tactics.fsdp(d)]}
    d, m = names  # an expert picks which axis carries which parallelism: both ways round
    return {
        "data_parallel": [tactics.batch_over_all_axes()],
        "megatron_dp": [tactics.data_parallel(d), tactics.megatron(m)],
        "dp_megatron": [tactics.data_parallel(m), tactics.megatron(d)],
        "fsdp": [tactics.fsdp(d)],
        "fsdp_tp": [tactics.data_parallel(d), tactics.megatron(m), tactics.fsdp(d)],
        "tp_fsdp": [tactics.data_parallel(m), tactics.megatron(d), tactics.fsdp(m)],
    }


def expert_plans(space, ctx, root, axes: dict) -> dict:
    """name -> state: the named expert plans and every composition of the tactics (one per mesh
    axis; e.g. data parallel over one axis and FSDP over the other is HSDP)."""
    plans = {k: run_schedule(v, ctx, root).state for k, v in experts(axes).items()}
    for seq in search.compose.tactic_compositions(space, limit=4 ** len(axes)):
        state, done = search.greedy.replay(space, seq)
        if done:
            plans.setdefault(" + ".join(space.describe(a) for a in done), state)
    return plans


def measured(w, state, axes: dict) -> tuple[int, float, int]:
    """XLA-measured (collective buffer bytes, bytes sent per device, memory per device) of the
    program emitted for ``state``."""
    import jax

    from automap import emit

    mesh = automap.make_mesh(axes)
    jitted = emit.compile_plan(state, mesh, pins=emit.pinned_values(state))
    flat = jax.tree.leaves(w.abstract())
    m = automap.measure(jitted.lower(*flat).compile())
    return m.collective_bytes, m.wire_bytes, m.memory_per_device


def quality(args, topo) -> None:
    print("(a) quality: estimated step time, ratio MCTS / best fitting expert (<= 1 is as good or better); "
          "'vs ILP': MCTS / the exact solver's optimum (a tactic composition, then one or two actions per group), "
          "under the same expert ceiling (2-layer models; *: the solver stopped at its limits before proving "
          "optimality, its note follows); "
          "experts: the named plans and every composition of the tactics")
    print(f"{'model':<14} {'mesh':<4} {'budget':<9} {'best expert':<44} {'expert ms':>9} {'mcts ms':>9} "
          f"{'ratio':>6} {'greedy':>6} {'vs ILP':>9} {'fits':>4}  plan")
    layer_set = (2,) if args.quick else tuple(int(n) for n in args.layers.split(","))
    xla: list[tuple] = []
    for layers in layer_set:
        for scan in (True, False):
            for mesh_name, axes in MESHES.items():
                if (args.quick and mesh_name != "2x4") or (args.meshes and mesh_name not in args.meshes.split(",")):
                    continue
                w, p, ctx, root = setup(layers, scan, axes)
                dp = search.SearchSpace(root, topology=topo, context=ctx).score(
                    run_schedule([tactics.batch_over_all_axes()], ctx, root).state)
                for budget in (None, int(dp.peak_bytes * 0.8)):
                    config = f"{'scan' if scan else 'unroll'}-{'none' if budget is None else 'budget'}"
                    if args.configs and config not in args.configs.split(","):
                        continue
                    space = search.SearchSpace(root, topology=topo, memory_budget=budget,
                                               data_inputs=ctx.data_inputs, context=ctx)
                    plans = expert_plans(space, ctx, root, axes)
                    fitting = {k: space.score(st) for k, st in plans.items() if space.score(st).feasible}
                    name, best = min(fitting.items(), key=lambda kv: kv[1].time_s) if fitting else ("-", None)
                    result = search.MCTS(episodes=args.episodes, seed=0).search(space)
                    ceiling = search.expert_ceiling(space)
                    greedy = search.Greedy().search(search.SearchSpace(
                        root, topology=topo, memory_budget=budget, data_inputs=ctx.data_inputs, context=ctx))
                    ilp_txt, ilp_note = "-", ""
                    if layers == 2:
                        try:
                            exact = search.ILP(ceiling=ceiling, max_evaluations=args.ilp_evaluations,
                                               time_limit_s=args.ilp_time_limit).search(search.SearchSpace(
                                root, topology=topo, memory_budget=budget, data_inputs=ctx.data_inputs, context=ctx))
                            fits = exact.score.feasible and (ceiling is None or ceiling.admits(exact.score))
                            proved = "" if exact.notes == (search.ilp.OPTIMAL,) else "*"
                            ilp_note = (f"\n    ILP: {'proved' if not proved else exact.notes[0]}; "
                                        f"{exact.stats.states_evaluated} cost evaluations, {exact.stats.wall_time_s:.0f} s")
                            ilp_txt = f"{result.score.time_s / exact.score.time_s:.3f}{proved}" if fits else "none fits"
                        except search.TooLarge:
                            ilp_txt = "too large"
                    ratio = result.score.time_s / best.time_s if best else float("nan")
                    g_ratio = greedy.score.time_s / best.time_s if best else float("nan")
                    label = f"{'scan' if scan else 'unroll'}-{layers}"
                    if best is not None and args.measure:
                        cb, wb, mb = measured(w, plans[name], axes)
                        cm, wm, mm = measured(w, result.state, axes)
                        xla.append((label, mesh_name, budget, name, cm / max(cb, 1), wm / max(wb, 1), mm / mb,
                                    mm, result.score.peak_bytes))
                    btxt = "none" if budget is None else f"{budget / 2**20:.0f}MiB"
                    print(f"{label:<14} {mesh_name:<4} {btxt:<9} {name:<44} {best.time_s * 1e3 if best else 0:>9.3f} "
                          f"{result.score.time_s * 1e3:>9.3f} {ratio:>6.3f} {g_ratio:>6.3f} {ilp_txt:>9} "
                          f"{'yes' if result.score.feasible else 'NO':>4}  {', '.join(result.describe(space))}"
                          f"{ilp_note}", flush=True)
    _print_measured(xla)


def _print_measured(xla: list[tuple]) -> None:
    if not xla:
        return
    print("    XLA-measured, MCTS plan / best fitting expert plan (compiled on 8 CPU devices); 'sent': bytes "
          "each device sends (ring traffic), 'buffers': collective buffer bytes")
    for label, mesh_name, budget, name, coll, wire, mem, xla_bytes, est_bytes in xla:
        btxt = "none" if budget is None else f"{budget / 2**20:.0f}MiB"
        fits = budget is None or xla_bytes <= budget
        print(f"    {label:<10} {mesh_name:<4} {btxt:<7} vs {name:<44} sent {wire:6.3f}  buffers {coll:6.3f}  "
              f"memory/device {mem:6.3f}  within budget: {'yes' if fits else 'NO'} (MCTS plan: XLA "
              f"{xla_bytes / 2**20:.1f} MiB, estimated {est_bytes / 2**20:.1f} MiB)")


def recovery(args, topo) -> None:
    axes = MESHES["2x4"]
    w, p, ctx, root = setup(2, True, axes)
    target = search.SearchSpace(root, topology=topo, context=ctx).score(
        run_schedule([tactics.data_parallel("data"), tactics.megatron("model")], ctx, root).state)
    wins = 0
    for seed in range(10):
        space = search.SearchSpace(root, topology=topo, data_inputs=ctx.data_inputs, context=ctx)
        r = search.MCTS(episodes=args.episodes, seed=seed).search(space)
        ok = r.score.time_s <= target.time_s * (1 + 1e-9)
        wins += ok
        print(f"  seed {seed}: {r.score.time_s * 1e3:.3f} ms vs megatron+dp {target.time_s * 1e3:.3f} ms "
              f"{'ok' if ok else 'worse'}  {', '.join(r.describe(space))}", flush=True)
    print(f"(b) recovery: {wins}/10 seeds at least as good as Megatron + data parallel (mesh 2x4)")


def scaling(args, topo) -> None:
    print("(c) scaling: MCTS search time (tracing and lowering excluded)")
    for scan in (True, False):
        times = {}
        for layers in ((2, 12) if args.quick else (2, 12, 24, 48)):
            if not scan and layers > 24:
                continue
            _, p, ctx, root = setup(layers, scan, MESHES["2x4"])
            t0 = time.perf_counter()
            space = search.SearchSpace(root, topology=topo, data_inputs=ctx.data_inputs, context=ctx)
            r = search.MCTS(episodes=args.episodes, seed=0).search(space)
            times[layers] = time.perf_counter() - t0
            print(f"  {'scanned' if scan else 'unrolled'} {layers:>2} layers: {times[layers]:6.2f} s, "
                  f"{len(space.groups)} decision groups, {r.stats.states_evaluated} plans evaluated", flush=True)
        if 48 in times:
            print(f"  scanned: time at 48 layers / 12 layers = {times[48] / times[12]:.2f} (target <= 1.5)")


def plan_time(args, topo) -> None:
    """(p) the whole default ``plan()`` (tracing, lowering, MCTS) of the 12-layer unrolled GPT,
    on the default topology of this backend (cpu-sim on CPU)."""
    w = zoo.gpt_linen(zoo.GPTConfig(layers=12, scan=False, **SIZE))
    t0 = time.perf_counter()
    plan = automap.automap(w.train_step, mesh=automap.make_mesh(MESHES["2x4"])).plan(*w.abstract())
    total = time.perf_counter() - t0
    note = next(n for n in plan.notes if n.startswith("search mcts"))
    print(f"(p) default plan() of the 12-layer unrolled GPT, mesh 2x4: {total:.2f} s (target <= 10 s); {note}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--episodes", type=int, default=48)
    parser.add_argument("--topology", default="h100-8")
    parser.add_argument("--parts", default="abcp")
    parser.add_argument("--layers", default="2,12", help="(a): model depths, comma-separated")
    parser.add_argument("--configs", default="", help="(a): only these, comma-separated (of scan-none, scan-budget, "
                        "unroll-none, unroll-budget: scanned or unrolled, without a budget or under 0.8x data parallel's)")
    parser.add_argument("--meshes", default="", help=f"(a): only these meshes, comma-separated (of {', '.join(MESHES)})")
    parser.add_argument("--ilp-evaluations", type=int, default=30000, help="(a): search.ILP(max_evaluations=...)")
    parser.add_argument("--ilp-time-limit", type=float, default=1800.0, help="(a): search.ILP(time_limit_s=...)")
    parser.add_argument("--measure", action="store_true", help="(a): also compile the plans and measure them")
    args = parser.parse_args()
    topo = Topology.preset(args.topology)
    if "a" in args.parts:
        quality(args, topo)
    if "b" in args.parts:
        recovery(args, topo)
    if "c" in args.parts:
        scaling(args, topo)
    if "p" in args.parts:
        plan_time(args, topo)
    return 0


if __name__ == "__main__":
    sys.exit(main())
