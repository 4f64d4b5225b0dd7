"""The search at cluster scale, by estimate only (abstract inputs, nothing compiled or run).

    python benchmarks/scale.py [--parts abc] [--batch 32] [--out scale.md]

(a) 70b: a Llama-2-70B shape (d_model 8192, 80 layers, 64 heads, 8 key/value heads, SwiGLU MLP
    28672, vocab 32000, seq 4096; scanned, remat) on 64 devices, mesh data=8 x model=8 on 8 nodes
    of 8 H100 (``data`` crosses the nodes over InfiniBand, ``model`` stays in a node on NVLink):
    the default plan (``plan()`` with no tactics) against every schedule of one or two tactics
    (data_parallel, fsdp, megatron; each axis carries one or none, so both axis orders) and the
    ``fsdp_tp`` preset both ways round. Target: default <= every schedule that fits the memory.
(b) 3-axis: mesh data=2 x fsdp=2 x model=2 (one H100 node), a 12-layer GPT with d_model 1024: the
    default plan against every assignment of data_parallel / fsdp / megatron (or none) to the
    three axes. Target: default <= every assignment that fits.
(c) axes: the wall time of the default ``plan()`` of (b)'s GPT on 16 devices as a 2-axis mesh
    (4x4) and a 4-axis mesh (2x2x2x2), side by side. Target: 4-axis <= 2x the 2-axis time.

Every table gives each plan's estimated step time, peak memory per device and whether it fits the
device memory (the default search's budget), and the ratio schedule / default (>= 1: the default
is as good or better). Prints markdown; ``--out FILE`` also writes it to FILE (nothing is written
without it).
"""
from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=64"
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

import automap  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402
from automap.cost import default_topology  # noqa: E402

TACTICS = {"dp": tactics.data_parallel, "megatron": tactics.megatron, "fsdp": tactics.fsdp}  # run in this order
TOL = 1e-9  # relative: the default "ties" a schedule within this


def llama70b(batch: int, seq: int, vocab: int) -> zoo.GPTConfig:
    return zoo.GPTConfig(vocab=vocab, seq=seq, d_model=8192, heads=64, kv_heads=8, layers=80, ffn=28672,
                         gated_mlp=True, scan=True, remat=True, batch=batch)


def gpt_1024(scan: bool) -> zoo.GPTConfig:
    return zoo.GPTConfig(vocab=8192, seq=1024, d_model=1024, heads=16, layers=12, batch=16, scan=scan)


def assignments(axes: list[str], max_tactics: int) -> dict[str, list]:
    """name -> schedule: each axis carries one of the tactics or none, at most ``max_tactics``
    tactics in all, run data_parallel first, then megatron, then fsdp (the presets' order)."""
    out = {}
    for choice in itertools.product([None, *TACTICS], repeat=len(axes)):
        used = [(t, a) for t, a in zip(choice, axes, strict=True) if t is not None]
        if not used or len(used) > max_tactics:
            continue
        used.sort(key=lambda ta: list(TACTICS).index(ta[0]))
        out[" + ".join(f"{t}({a})" for t, a in used)] = [TACTICS[t](a) for t, a in used]
    return out


def estimate(w, mesh, topology, schedule) -> tuple[float, int, float, str]:
    """(estimated step s, peak bytes per device, plan s, what the search chose) of ``schedule``
    (None: the default search)."""
    options = {} if schedule is None else dict(tactics=schedule, search=None)
    t0 = time.perf_counter()
    plan = automap.partition(w.train_step, mesh=mesh, topology=topology, arbiter=None,  # estimates only
                             **options).plan(*w.abstract())
    plan_s = time.perf_counter() - t0
    est = plan.estimate
    chose = "; ".join(n[len("search: "):] for n in plan.notes if n.startswith("search: "))
    return est.time_s, est.peak_memory_bytes, plan_s, chose


class Report:
    """Lines printed as they come and kept for ``--out``."""

    def __init__(self):
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        self.lines.append(line)
        print(line, flush=True)


def compare(out: Report, title: str, w, axes: dict, topology, schedules: dict[str, list]) -> None:
    mesh = automap.make_mesh(axes)
    budget = topology.device.memory_bytes
    d_time, d_peak, d_plan, d_chose = estimate(w, mesh, topology, None)
    rows = [(name, *estimate(w, mesh, topology, s)[:2]) for name, s in schedules.items()]
    out(f"### {title}")
    out()
    out(f"mesh {axes}, topology {topology.name} "
        f"({', '.join(f'{a}: {l.bandwidth / 1e9:.0f} GB/s' for a, l in topology.links_for(axes).items())}), "
        f"memory budget {budget / 2**30:.0f} GiB; default plan() {d_plan:.1f} s, its search chose: {d_chose}")
    out()
    out("| plan | est. step (s) | peak/device (GiB) | fits | schedule / default |")
    out("|---|---:|---:|---|---:|")
    out(f"| **default** | {d_time:.3f} | {d_peak / 2**30:.1f} | {'yes' if d_peak <= budget else 'NO'} | 1.000 |")
    for name, t, peak in sorted(rows, key=lambda r: (r[2] > budget, r[1])):
        out(f"| {name} | {t:.3f} | {peak / 2**30:.1f} | {'yes' if peak <= budget else 'no'} | {t / d_time:.3f} |")
    fitting = [r for r in rows if r[2] <= budget]
    out()
    if fitting:
        name, t, _ = min(fitting, key=lambda r: r[1])
        ok = d_time <= t * (1 + TOL)
        out(f"default {d_time:.3f} s vs best fitting schedule `{name}` {t:.3f} s: default / best = "
            f"{d_time / t:.3f} (target <= 1: {'met' if ok else 'NOT met'})")
    else:
        out("no schedule fits the memory budget")
    out()


def part_70b(out: Report, args) -> None:
    w = zoo.gpt_linen(llama70b(args.batch, args.seq, args.vocab))
    axes = {"data": 8, "model": 8}
    schedules = assignments(list(axes), 2)
    schedules["fsdp_tp(data, model) (preset)"] = [tactics.fsdp_tp("data", "model")]
    schedules["fsdp_tp(model, data) (preset)"] = [tactics.fsdp_tp("model", "data")]
    compare(out, f"(a) Llama-2-70B shape (GQA 64/8 heads, batch {args.batch} x seq {args.seq}), 8 nodes x 8 H100",
            w, axes, default_topology(64, "gpu"), schedules)


def part_3axis(out: Report, args) -> None:
    w = zoo.gpt_linen(gpt_1024(not args.unroll))
    axes = {"data": 2, "fsdp": 2, "model": 2}
    compare(out, f"(b) 12-layer GPT d_model 1024 ({'unrolled' if args.unroll else 'scanned'}), 3-axis mesh",
            w, axes, default_topology(8, "gpu"), assignments(list(axes), 3))


def part_axes(out: Report, args) -> None:
    w = zoo.gpt_linen(gpt_1024(not args.unroll))
    topology = default_topology(16, "gpu")
    meshes = {"2 axes": {"a": 4, "b": 4}, "4 axes": {"a": 2, "b": 2, "c": 2, "d": 2}}
    out(f"### (c) default plan() wall time by mesh axes, 16 devices ({topology.name}), "
        f"12-layer GPT d_model 1024 ({'unrolled' if args.unroll else 'scanned'})")
    out()
    out("| mesh | plan() (s) | est. step (s) | vs 2 axes |")
    out("|---|---:|---:|---:|")
    times = {}
    for name, axes in meshes.items():
        t, _, plan_s, _ = estimate(w, automap.make_mesh(axes), topology, None)
        times[name] = plan_s
        out(f"| {name} {axes} | {plan_s:.1f} | {t:.3f} | {plan_s / times['2 axes']:.2f} |")
    ratio = times["4 axes"] / times["2 axes"]
    out()
    out(f"4-axis / 2-axis plan() time = {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'})")
    out()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="abc", help="which of (a) 70b, (b) 3-axis, (c) axes to run")
    parser.add_argument("--batch", type=int, default=32, help="(a): global batch in sequences")
    parser.add_argument("--seq", type=int, default=4096, help="(a): sequence length")
    parser.add_argument("--vocab", type=int, default=32000, help="(a): 32000 (Llama 2) or 128256 (Llama 3)")
    parser.add_argument("--unroll", action="store_true", help="(b), (c): the 12-layer GPT unrolled (default scanned)")
    parser.add_argument("--out", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    out = Report()
    out(f"Generated by `python benchmarks/scale.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        "(estimates only: nothing compiled)")
    out()
    for part, run in (("a", part_70b), ("b", part_3axis), ("c", part_axes)):
        if part in args.parts:
            run(out, args)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(out.lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
