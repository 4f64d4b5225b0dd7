"""Megatron-LM sharding benchmark: expert plans and automap's search on GPT-2 shaped models.

    python -m automap bench megatron [--quick] [--out DIR] [--episodes N] [--topologies h100-8,h100-2x8]

Results go to ``--out`` (default: a new folder ``bench_results/megatron-<date>-<time>``; the
committed ``docs/megatron_results.*`` are regenerated with ``--out docs``).
    python benchmarks/megatron.py ...            (the same)

Models follow the GPT-2 / Megatron-LM scaling table (vocab 50304, seq 1024, global batch 32,
activation checkpointing of every layer as Megatron-LM does; without it no strategy fits GPT-2 XL
in 80 GiB at this batch):

=========  ======  =======  =====  ===========================================================
config     layers  d_model  heads  note
=========  ======  =======  =====  ===========================================================
gpt2-s     12      768      24     GPT-2 small has 12 heads; 24 so that 8-way Megatron divides
gpt2-m     24      1024     16
gpt2-l     36      1280     32     GPT-2 large has 20 heads
gpt2-xl    48      1600     32     GPT-2 XL has 25 heads
gpt-2.5b   54      1920     24     Megatron-LM's 2.5B has 20 heads
=========  ======  =======  =====  ===========================================================

They are traced abstractly (``w.abstract()``, scanned layers) and only planned and estimated on
the H100 presets; nothing of their size is compiled. ``--quick`` uses a tiny model (2 layers, d_model 64, vocab 512, seq 32,
batch 16) compiled on the simulated 8-device CPU mesh (the XLA-measured columns) and GPT-2 small, estimated.

Meshes: 8 devices as data x model 8x1, 4x2, 2x4, 1x8 (axes of size 1 are kept in the mesh; no
tactic is given for them). Topologies: ``h100-8`` (one node, NVLink) and ``h100-2x8`` with the 8
devices spread over its two nodes, 4 per node (an axis whose devices span both nodes gets
InfiniBand; with 8 devices in one node the 2x8 preset would equal h100-8).

Strategies (the expert ones are tactic schedules; every mesh axis of size > 1 is used where the
strategy has a use for it):

- ``data_parallel``: the batch over every mesh axis (8-way DP on every mesh)
- ``megatron``: tensor parallelism on ``model`` only, the data axis left idle (replicated)
- ``megatron_dp``: Megatron on ``model`` + data parallel on ``data``
- ``fsdp``: the batch over every axis, training state sharded (ZeRO-3) over every axis
- ``fsdp_megatron``: data parallel + FSDP on ``data``, Megatron on ``model``
- ``megatron_dp_sp``: ``megatron_dp`` with Megatron-LM sequence parallelism on ``model``
  (``tactics.sequence_parallel``: the layer-norm/residual regions split on the sequence, each
  all-reduce a reduce-scatter + all-gather), as in "Reducing Activation Recomputation"
- ``megatron_dp_sp_selective``: ``megatron_dp_sp`` with selective recomputation in place of the
  model's remat of every layer (the same model without ``remat``; ``tactics.recompute("selective")``:
  the weight matmuls' results kept, attention's core, norms and activations redone in the
  backward), the paper's other half
- ``automap_mcts``: no tactics, ``search.MCTS(episodes=N, seed=0)``, ``arbiter=None`` (the answer by estimate, nothing compiled), with the device memory as budget;
  the search may drop the model's remat (and recompute selectively in its place) where the
  objective finds that better (:mod:`automap.ir.unremat`); the note says so
- ``automap_ilp``: ``search.ILP(max_evaluations=300, time_limit_s=5)`` when the package has it (else
  "n/a (no ILP solver yet)"); a space that needs more cost evaluations than that is reported n/a
  (TooLarge); after 5 s of solving, the best plan found so far stands

A MoE section follows (the corpus GShard-style top-2 ``moe_einsum``, mesh 2x4; ``moe-tiny``
compiled with ``--quick``, ``moe-s`` estimated otherwise): ``megatron_dp`` (each expert's FFN split),
``expert_dp`` (data parallel + ``tactics.expert_parallel('model')``), ``expert_megatron_dp`` (and
Megatron on the same axis: the vocab-parallel embedding and head) and the default search. Last, a
table of what each addition changes (sequence parallelism over ``megatron_dp``, expert
parallelism over ``megatron_dp``, Megatron over ``expert_dp``): bytes, memory and estimated step.

Columns: estimated per-device peak memory and whether it fits the device, estimated collective
bytes per device per step, estimated step time (compute + communication, no overlap), XLA
figures where compiled, plan time (trace + plan + search), and the step time over the best expert
plan that fits (the automap rows' ratio is the headline: <= 1 means automap is as good).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

CONFIGS = {
    "gpt2-s": dict(layers=12, d_model=768, heads=24),
    "gpt2-m": dict(layers=24, d_model=1024, heads=16),
    "gpt2-l": dict(layers=36, d_model=1280, heads=32),
    "gpt2-xl": dict(layers=48, d_model=1600, heads=32),
    "gpt-2.5b": dict(layers=54, d_model=1920, heads=24),
}
PAPER_HEADS = {"gpt2-s": 12, "gpt2-l": 20, "gpt2-xl": 25, "gpt-2.5b": 20}
FULL = dict(vocab=50304, seq=1024, batch=32, remat=True)  # activation checkpointing, as Megatron-LM
TINY = {"tiny": dict(layers=2, d_model=64, heads=8, vocab=512, seq=32, batch=16)}
QUICK_CONFIGS = ("tiny", "gpt2-s")
MESHES = {"8x1": (8, 1), "4x2": (4, 2), "2x4": (2, 4), "1x8": (1, 8)}
QUICK_MESHES = ("2x4",)
EXPERTS = ("data_parallel", "megatron", "megatron_dp", "fsdp", "fsdp_megatron", "megatron_dp_sp",
           "megatron_dp_sp_selective")
NO_REMAT = ("megatron_dp_sp_selective",)  # strategies planned on the model without its own remat
STRATEGIES = EXPERTS + ("automap_mcts", "automap_ilp")
MOE_CONFIGS = {  # corpus moe_einsum (MoEConfig fields); GPT-2 small's width with 8 experts of 4x hidden
    "moe-tiny": dict(),
    "moe-s": dict(vocab=50304, seq=1024, d_model=768, hidden=3072, experts=8, batch=32),
}
QUICK_MOE = ("moe-tiny",)
MOE_MESH = "2x4"
MOE_EXPERTS = ("megatron_dp", "expert_dp", "expert_megatron_dp")
MOE_STRATEGIES = MOE_EXPERTS + ("automap_mcts",)
NA_ILP = "n/a (no ILP solver yet)"


def topology(name: str):
    """The cost-model topology for 8 devices; ``h100-2x8`` places them 4 per node on 2 nodes."""
    from automap.cost.topology import Level, Topology

    t = Topology.preset(name)
    if name == "h100-2x8":
        inner, outer = t.levels
        t = Topology("h100-2x8", t.device, (Level(4, inner.link, inner.name), Level(2, outer.link, outer.name)))
    return t


def strategy_tactics(name: str, axes: dict[str, int]) -> list:
    """The tactic schedule of expert strategy ``name`` on a data x model mesh (sizes may be 1)."""
    import tactics

    big = [a for a in ("data", "model") if axes[a] > 1]
    batch = [tactics.batch_over_all_axes()]
    dp = [tactics.data_parallel("data")] if axes["data"] > 1 else []
    tp = [tactics.megatron("model")] if axes["model"] > 1 else []
    if name == "data_parallel":
        return batch
    if name == "megatron":
        return tp
    if name == "megatron_dp":
        return dp + tp
    if name == "fsdp":
        return batch + [tactics.fsdp(a) for a in big]
    if name == "fsdp_megatron":
        return dp + tp + ([tactics.fsdp("data")] if axes["data"] > 1 else [])
    if name in ("megatron_dp_sp", "megatron_dp_sp_selective"):
        sp = [tactics.sequence_parallel("model")] if axes["model"] > 1 else []
        return dp + tp + sp + ([tactics.recompute("selective")] if name == "megatron_dp_sp_selective" else [])
    ep = [tactics.expert_parallel("model")] if axes["model"] > 1 else []
    if name == "expert_dp":
        return dp + ep
    if name == "expert_megatron_dp":
        return dp + ep + tp
    raise ValueError(f"unknown strategy {name!r}; expected one of {EXPERTS + MOE_EXPERTS}")


def _coll_bytes(estimate, axes: dict[str, int]) -> int:
    """Collective bytes per device, leaving out collectives over axes of size 1 (no traffic)."""
    return sum(c.bytes * c.count for c in estimate.collectives if math.prod(axes[a] for a in c.axes) > 1)


def _chosen(plan) -> str:
    """What the input shardings of ``plan`` come from (tactics and explicit actions), in order."""
    seen: list[str] = []
    for v in plan.program.inputs:
        for d in range(plan.program.values[v].ndim):
            for part in (plan.state.why(v, d) or "").split("; "):
                part = part.removeprefix("search: ")
                if part and part not in seen:
                    seen.append(part)
    return "from " + ", ".join(seen) if seen else "nothing sharded"


def _params(state) -> float:
    import jax

    return sum(math.prod(x.shape) for x in jax.tree.leaves(state["params"])) / 1e6


def _row(cfg, params_m, mesh_name, topo, strategy, plan, axes, plan_s, measured=None, note=""):
    e = plan.estimate
    return dict(
        config=cfg, params_m=round(params_m, 1), mesh=mesh_name, topology=topo.name, strategy=strategy,
        mem_gib=e.peak_memory_bytes / 2**30, fits=e.peak_memory_bytes <= topo.device.memory_bytes,
        coll_mib=_coll_bytes(e, axes) / 2**20, time_ms=e.time_s * 1e3,
        xla_mem_gib=None if measured is None else measured.memory_per_device / 2**30,
        xla_coll_mib=None if measured is None else measured.collective_bytes / 2**20,
        plan_s=plan_s, vs_best_expert=None, note=note,
        # bytes on the wire (an all-reduce sends twice its buffer, a reduce-scatter + all-gather once each)
        wire_mib=e.wire_bytes / 2**20, xla_wire_mib=None if measured is None else measured.wire_bytes / 2**20,
    )


def run(quick: bool = False, episodes: int = 48, topologies: tuple[str, ...] | None = None,
        configs: tuple[str, ...] | None = None, meshes: tuple[str, ...] | None = None,
        compile: bool | None = None, ilp_evaluations: int = 300, ilp_time_limit_s: float = 5.0,
        log=functools.partial(print, flush=True)) -> list[dict]:
    """Run the benchmark; one row per (config, mesh, topology, strategy). ``configs`` may name
    GPT configs and MoE configs (:data:`MOE_CONFIGS`, planned on mesh 2x4 only)."""
    from automap import zoo
    from automap.zoo.corpus.moe import MoEConfig, moe_einsum

    shapes = TINY | {k: dict(v, **FULL) for k, v in CONFIGS.items()}
    configs = configs or (QUICK_CONFIGS + QUICK_MOE if quick else tuple(CONFIGS) + ("moe-s",))
    meshes = meshes or (QUICK_MESHES if quick else tuple(MESHES))
    topologies = topologies or (("h100-8",) if quick else ("h100-8", "h100-2x8"))
    topos = [topology(t) for t in topologies]
    ilp = (ilp_evaluations, ilp_time_limit_s)
    rows: list[dict] = []
    for cfg in configs:
        moe = cfg in MOE_CONFIGS
        w = moe_einsum(MoEConfig(**MOE_CONFIGS[cfg])) if moe else zoo.gpt_linen(zoo.GPTConfig(scan=True, **shapes[cfg]))
        plain = {} if moe else {s: zoo.gpt_linen(zoo.GPTConfig(scan=True, **dict(shapes[cfg], remat=False)))
                                for s in NO_REMAT}
        compiled = cfg in TINY or cfg in QUICK_MOE if compile is None else compile  # only tiny models fit the CPU
        for mesh_name in ((MOE_MESH,) if moe else meshes):
            rows.extend(_mesh_rows(w, cfg, mesh_name, topos, MOE_EXPERTS if moe else EXPERTS, episodes, compiled,
                                   None if moe else ilp, log, plain))
    return rows


def _mesh_rows(w, cfg: str, mesh_name: str, topos: list, experts: tuple[str, ...], episodes: int, compiled: bool,
               ilp: tuple[int, float] | None, log, variants: dict | None = None) -> list[dict]:
    """The rows of one workload on one mesh: each expert strategy (on ``variants[strategy]``, the
    workload a strategy needs instead, if any), the MCTS search and (with ``ilp``: (max
    evaluations, time limit)) the ILP, under every topology."""
    import automap
    import search
    from search.planning import MemoryBudgetError

    state, batch = w.abstract()
    params_m = _params(state)
    d, m = MESHES[mesh_name]
    axes = {"data": d, "model": m}
    mesh = automap.make_mesh(axes)
    group: list[dict] = []
    # expert plans: planned once, estimated under every topology
    for strategy in experts:
        t0 = time.perf_counter()
        wk = (variants or {}).get(strategy, w)
        args = (state, batch) if wk is w else wk.abstract()
        step = automap.automap(wk.train_step, mesh=mesh, tactics=strategy_tactics(strategy, axes),
                               topology=topos[0], search=None)  # the tactics alone, no search
        plan = step.plan(*args)
        plan_s = time.perf_counter() - t0
        measured = automap.measure(step.lower(*args).compile()) if compiled else None
        redone = plan.state.program.recomputed
        note = f"recomputes {', '.join(redone)}" if redone else ""
        for topo in topos:
            p = plan if topo is topos[0] else dataclasses.replace(plan, topology=topo)
            group.append(_row(cfg, params_m, mesh_name, topo, strategy, p, axes, plan_s, measured, note=note))
    for topo in topos:
        t0 = time.perf_counter()
        plan, tries = None, []
        for n in (episodes, 4 * episodes):  # one retry with 4x the episodes if nothing fit
            step = automap.automap(w.train_step, mesh=mesh, tactics=[], topology=topo,
                                   search=search.MCTS(episodes=n, seed=0), arbiter=None)  # the answer by estimate
            try:
                plan = step.plan(state, batch)
                break
            except MemoryBudgetError as e:
                tries.append(f"{n} episodes: {str(e).split('. Largest')[0]}")
        plan_s = time.perf_counter() - t0
        if plan is None:
            group.append(dict(config=cfg, params_m=round(params_m, 1), mesh=mesh_name, topology=topo.name,
                              strategy="automap_mcts", plan_s=plan_s, note="FAILED: " + "; ".join(tries)))
        else:
            measured = automap.measure(step.lower(state, batch).compile()) if compiled else None
            chosen = (f"{4 * episodes} episodes after a failed first try; " if tries else "") + _chosen(plan) + (
                "; drops the model's remat" if plan.state.program.dropped_remat else "") + (
                f"; recomputes {', '.join(plan.state.program.recomputed)}" if plan.state.program.recomputed else "")
            group.append(_row(cfg, params_m, mesh_name, topo, "automap_mcts", plan, axes, plan_s, measured,
                              note=chosen))
        if ilp is None:
            continue
        if hasattr(search, "ILP"):
            t0 = time.perf_counter()
            step = automap.automap(w.train_step, mesh=mesh, tactics=[], topology=topo, arbiter=None,
                                   search=search.ILP(max_evaluations=ilp[0], time_limit_s=ilp[1]))
            try:
                plan = step.plan(state, batch)
                group.append(_row(cfg, params_m, mesh_name, topo, "automap_ilp", plan, axes,
                                  time.perf_counter() - t0, note=_chosen(plan)))
            except (search.TooLarge, MemoryBudgetError) as e:
                group.append(dict(config=cfg, params_m=round(params_m, 1), mesh=mesh_name,
                                  topology=topo.name, strategy="automap_ilp",
                                  plan_s=time.perf_counter() - t0,
                                  note=f"n/a ({type(e).__name__}: {str(e).split(': use')[0].split('. ')[0]})"))
        else:
            group.append(dict(config=cfg, params_m=round(params_m, 1), mesh=mesh_name, topology=topo.name,
                              strategy="automap_ilp", note=NA_ILP))
    for topo in topos:
        mine = [r for r in group if r["topology"] == topo.name and "time_ms" in r]
        fitting = [r for r in mine if r["strategy"] in experts and r["fits"]] or [
            r for r in mine if r["strategy"] in experts]
        best = min(r["time_ms"] for r in fitting)
        for r in mine:
            r["vs_best_expert"] = r["time_ms"] / best
    for r in group:
        if r["strategy"] == "automap_mcts" and "time_ms" in r:
            log(f"{cfg:<9} {mesh_name:<4} {r['topology']:<9} automap/best expert {r['vs_best_expert']:.3f} "
                f"({r['time_ms']:.2f} ms, plan {r['plan_s']:.1f} s): {r['note']}")
        elif r["strategy"] == "automap_mcts":
            log(f"{cfg:<9} {mesh_name:<4} {r['topology']:<9} automap {r['note']}")
    order = {t.name: i for i, t in enumerate(topos)}
    return sorted(group, key=lambda r: order[r["topology"]])  # stable: strategies stay in order


def fresh_folder(parent: str = "bench_results") -> str:
    """A folder under ``parent`` that does not exist yet, named by the time (the default ``--out``:
    a run never overwrites earlier results, nor the committed ``docs/``).

    >>> import os, tempfile
    >>> parent = tempfile.mkdtemp()
    >>> a = fresh_folder(parent); os.makedirs(a); b = fresh_folder(parent)
    >>> a != b and os.path.basename(a).startswith("megatron-") and not os.path.exists(b)
    True
    """
    base = os.path.join(parent, time.strftime("megatron-%Y%m%d-%H%M%S"))
    path, k = base, 1
    while os.path.exists(path):
        path, k = f"{base}-{k}", k + 1
    return path


def main(argv: list[str] | None = None) -> int:
    from automap.bench_megatron_results import additions, markdown, plots, summary, write_csv  # it imports this

    parser = argparse.ArgumentParser(prog="python -m automap bench megatron", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny (compiled) + gpt2-s, mesh 2x4, h100-8")
    parser.add_argument("--out", default=None,
                        help="folder for megatron_results.md/.csv and the PNGs (default: a new folder "
                             "bench_results/megatron-<date>-<time>; the committed figures are made with --out docs)")
    parser.add_argument("--episodes", type=int, default=None, help="MCTS episodes (default 48, quick 16)")
    parser.add_argument("--topologies", default=None, help="comma separated, e.g. h100-8,h100-2x8")
    parser.add_argument("--configs", default=None, help=f"comma separated subset of {','.join(CONFIGS)}")
    parser.add_argument("--meshes", default=None, help="comma separated subset of 8x1,4x2,2x4,1x8")
    parser.add_argument("--ilp-evaluations", type=int, default=300, help="search.ILP(max_evaluations=...)")
    parser.add_argument("--ilp-time-limit", type=float, default=5.0, help="search.ILP(time_limit_s=...)")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    split = lambda s: tuple(s.split(",")) if s else None  # noqa: E731
    t0 = time.perf_counter()
    rows = run(quick=args.quick, episodes=args.episodes or (16 if args.quick else 48),
               topologies=split(args.topologies), configs=split(args.configs), meshes=split(args.meshes),
               ilp_evaluations=args.ilp_evaluations, ilp_time_limit_s=args.ilp_time_limit)
    elapsed = time.perf_counter() - t0
    args.out = args.out or fresh_folder()
    os.makedirs(args.out, exist_ok=True)
    table = markdown(rows)
    text = summary(rows)
    added = additions(rows)
    cmd = "python -m automap bench megatron " + " ".join(argv if argv is not None else sys.argv[1:])
    with open(os.path.join(args.out, "megatron_results.md"), "w") as f:
        f.write(f"Generated by `{cmd.strip()}` in {elapsed:.0f} s "
                f"({'quick: tiny model compiled on 8 simulated CPU devices, gpt2-s estimated' if args.quick else 'estimates only, nothing compiled'})."
                f"\n\n{table}\n{text}\n{added}")
    write_csv(rows, os.path.join(args.out, "megatron_results.csv"))
    if not args.no_plots:
        try:
            plots([r for r in rows if r["config"] not in MOE_CONFIGS], args.out)
        except ImportError:
            print("matplotlib is not installed: no plots (pip install -e '.[notebooks]', or pass --no-plots)")
            args.no_plots = True
    print(table)
    print(text)
    print(added, end="")
    print(f"{len(rows)} rows in {elapsed:.0f} s; written to {args.out}/megatron_results.md, .csv"
          + ("" if args.no_plots else " and megatron_*.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
