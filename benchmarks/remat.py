"""Issue 21's recomputation case measured: a zoo GPT with no remat in its code (unrolled layers,
or scanned with ``--scan``; Adam step, mesh data=2 x model=4 on 8 simulated CPU devices). The four expert plans (data
parallel, data parallel + Megatron, FSDP over both axes, FSDP + tensor parallel) are compiled and
measured; the memory budget is ``--ratio`` (0.8) times the smallest XLA-measured memory per
device among them; the default plan under that budget is compiled and measured, its loss held
against the unsharded step, and its estimate set beside the same plan without recomputation.

    python benchmarks/remat.py [--layers 4] [--ratio 0.8] [--scan]
    python benchmarks/remat.py --workload benchmarks/heldout_package_layers.py:eqx_rope

Each XLA measure is printed with its terms (argument + output - alias + temp): the arguments
and outputs are the sharded state in and out, which no recomputation shrinks.

``--workload FILE.py:FN`` measures a model from elsewhere (``FN()`` returns a workload, as for
``benchmarks/fidelity.py``) in place of the zoo GPT.
"""
import argparse
import dataclasses
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

import jax  # noqa: E402
import numpy as np  # noqa: E402

import automap  # noqa: E402
import search  # noqa: E402,F401  (before the benchmarks folder joins the path: --workload)
import tactics  # noqa: E402
from automap import zoo  # noqa: E402
from automap.cost import estimate  # noqa: E402
from automap.shardings import ShardingState  # noqa: E402

DP = tactics.data_parallel("data")
EXPERT_PLANS = {
    "data_parallel": DP,
    "megatron_dp": tactics.schedule(DP, tactics.megatron("model")),
    "fsdp": tactics.schedule(tactics.fsdp("data"), tactics.fsdp("model")),
    "fsdp_tp": tactics.fsdp_tp(),
}


def workload(layers: int, scan: bool = False) -> zoo.Workload:
    """Activations outweigh the parameters, as in training at scale."""
    return zoo.gpt_linen(zoo.GPTConfig(layers=layers, batch=16, seq=32, vocab=64, scan=scan))


def measured(step, state, batch):
    """(XLA's memory per device as :class:`automap.measure.MemoryStat`, the loss) of ``step`` on the mesh."""
    compiled = step.lower(state, batch).compile()
    return automap.measure(compiled).memory, float(step(state, batch)[1])


def terms(m) -> str:
    """XLA's total per device and its terms: the arguments and outputs (the sharded state, in and
    out: no plan can shrink them below the state over all devices) and the temporaries."""
    return (f"{m.per_device:>9,} B = argument {m.argument:,} + output {m.output:,}"
            + (f" - alias {m.alias:,}" if m.alias else "") + f" + temp {m.temp:,}")


def expert_memory(w, mesh, state, batch) -> dict:
    return {name: measured(automap.partition(w.train_step, mesh=mesh, tactics=[t], search=None), state, batch)[0]
            for name, t in EXPERT_PLANS.items()}


def without_recompute(plan) -> ShardingState:
    """The plan's state on the program as traced (the recomputed copies dropped)."""
    n, state = len(plan.program.values), plan.state
    return ShardingState(plan.program, state.axes, {v: s for v, s in state.specs.items() if v < n},
                         {k: p for k, p in state.priority.items() if k[0] < n}, state.frozen, state.next_priority,
                         state.labels)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--ratio", type=float, default=0.8)
    parser.add_argument("--scan", action="store_true", help="the layers in a scan (flax nn.scan)")
    parser.add_argument("--workload", metavar="FILE.py:FN", help="this model in place of the zoo GPT")
    args = parser.parse_args()
    if args.workload:
        sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the imports of search, tactics
        from fidelity import load_workload

        w = load_workload(args.workload)[1]()
    else:
        w = workload(args.layers, args.scan)
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    t0 = time.perf_counter()
    experts = expert_memory(w, mesh, state, batch)
    budget = int(args.ratio * min(m.per_device for m in experts.values()))
    step = automap.partition(w.train_step, mesh=mesh, memory_budget=budget)
    plan = step.plan(state, batch)
    stat, loss = measured(step, state, batch)
    memory = stat.per_device
    ref = float(jax.jit(w.train_step)(state, batch)[1])
    with_est, without_est = plan.estimate, estimate(without_recompute(plan), plan.topology)
    print(f"{w.name}, mesh data=2 x model=4, XLA memory per device of the expert plans:")
    for name, m in experts.items():
        print(f"  {name:<14} {terms(m)}")
    print(f"memory budget ({args.ratio} x the smallest): {budget:,} B")
    print(f"default plan: recomputes {', '.join(plan.state.program.recomputed) or 'nothing'}")
    for note in plan.notes:
        if "recompute" in note or "XLA" in note:
            print(f"  {note}")
    print(f"  XLA memory per device {memory:,} B ({memory / budget:.3f}x the budget: "
          f"{'fits' if memory <= budget else 'OVER'}); estimated {with_est.peak_memory_bytes:,} B")
    print(f"    XLA's terms: {terms(stat).split('= ')[1]}")
    print(f"  same plan without recompute: estimated {without_est.peak_memory_bytes:,} B")
    print(f"  estimated step {with_est.time_s * 1e3:.3f} ms with recompute, {without_est.time_s * 1e3:.3f} ms without "
          f"({with_est.time_s / without_est.time_s:.3f}x)")
    print(f"  loss {loss:.7f}, unsharded step {ref:.7f} (rel. diff {abs(loss - ref) / abs(ref):.1e})")
    print(f"({time.perf_counter() - t0:.0f} s)")
    assert np.isfinite(loss)


if __name__ == "__main__":
    main()
