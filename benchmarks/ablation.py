"""Stage ablation of the default search: each stage of ``search.MCTS().stages()`` on and off
against plan quality and search time.

    python benchmarks/ablation.py [--workloads gpt2,mlp] [--measure] [--topology h100-8] [--out ablation.md]

Variants (each a :class:`search.ChainSearch`): the full default chain (compose, tree, polish,
repair, sweep, polish, refine, tie; repair acts only under a binding memory budget, which these
workloads do not have), the default less one stage at a time (both polishes go together;
without ``compose`` the objective drops the expert ceiling too, as ``MCTS(seed_tactics=False)``
does), the tree alone, compose alone. Workloads: the zoo GPT (2 layers, unrolled and scanned),
the zoo MLP and three corpus models, each on mesh data=2 x model=4 (``--mesh``), planned by
``automap.automap(step, mesh=mesh, search=variant).plan(state, batch)`` (nothing compiled).

Per workload and variant: the estimated step time, bytes sent and peak memory per device of the
plan, the search's wall time (tracing and lowering excluded) and, with ``--measure``, XLA's bytes
sent and memory per device of the compiled program (8 CPU devices). Then per variant the ratio to
the full default, geometric mean over the workloads (> 1: worse than the full chain). Prints
markdown; ``--out FILE`` also writes it to FILE (nothing is written without it).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

import automap  # noqa: E402
import search  # noqa: E402
from automap import zoo  # noqa: E402
from automap.zoo import corpus  # noqa: E402
from search.planning import MemoryBudgetError  # noqa: E402

AXIS_NAMES = {1: ("data",), 2: ("data", "model"), 3: ("data", "fsdp", "model")}


def mesh_axes(text: str) -> dict[str, int]:
    """``"2x4"`` -> ``{"data": 2, "model": 4}``; three sizes name ``data``, ``fsdp``, ``model``.

    >>> mesh_axes("2x2x2")
    {'data': 2, 'fsdp': 2, 'model': 2}
    """
    sizes = [int(n) for n in text.split("x")]
    names = AXIS_NAMES.get(len(sizes), tuple(f"axis{i}" for i in range(len(sizes))))
    return dict(zip(names, sizes, strict=True))
GPT = dict(d_model=256, heads=8, vocab=2048, seq=128, batch=16)  # benchmarks/search.py's size
WORKLOADS = {
    "gpt2": lambda: zoo.gpt_linen(zoo.GPTConfig(layers=2, **GPT)),
    "gpt2-scan": lambda: zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True, **GPT)),
    "mlp": lambda: zoo.mlp(zoo.MLPConfig(d_in=512, hidden=(2048, 2048), d_out=512, batch=64)),
    "nnx_transformer": lambda: corpus.nnx_transformer(corpus.NNXTransformerConfig(
        vocab=2048, seq=128, d_model=256, heads=8, hidden=1024, layers=2, batch=16)),
    "llama_gqa": lambda: corpus.llama_gqa(corpus.LlamaConfig(
        vocab=2048, seq=128, d_model=256, heads=8, kv_heads=2, head_dim=32, hidden=768, layers=2, batch=16)),
    "linen_vit": lambda: corpus.linen_vit(corpus.ViTConfig(
        size=32, patch=4, d_model=256, heads=8, hidden=1024, layers=2, classes=128, batch=16)),
}
# (column, attribute of Row)
FIGURES = (("est. step", "time_s"), ("est. sent", "wire"), ("est. memory", "peak"), ("search s", "search_s"),
           ("XLA sent", "xla_wire"), ("XLA memory", "xla_mem"))


def variants(default: search.MCTS | None = None) -> dict[str, search.ChainSearch]:
    """name -> searcher: ``full``, ``-STAGE`` for each stage of ``default``'s chain, ``tree
    only``, ``compose only``.

    >>> list(variants())
    ['full', '-compose', '-tree', '-polish', '-repair', '-sweep', '-refine', '-tie', 'tree only', 'compose only']
    """
    default = default or search.MCTS()
    full = default.stages().stages
    names = list(dict.fromkeys(s.name for s in full))

    def of(name: str, keep: list[str]) -> search.ChainSearch:
        stages = search.chain(*(s for s in full if s.name in keep))
        return search.ChainSearch(stages, default.tie_tolerance, "compose" in keep and default.expert_ceiling, name)

    out = {"full": of("full", names)}
    out.update({f"-{n}": of(f"-{n}", [m for m in names if m != n]) for n in names})
    out["tree only"] = of("tree only", ["tree"])
    out["compose only"] = of("compose only", ["compose"])
    return out


@dataclasses.dataclass
class Row:
    time_s: float = math.nan
    wire: float = math.nan
    peak: float = math.nan
    search_s: float = math.nan
    xla_wire: float = math.nan
    xla_mem: float = math.nan
    chose: str = ""


class Recorded:
    """A searcher that keeps its last result (for the search's own wall time)."""

    def __init__(self, inner):
        self.inner, self.name, self.result = inner, inner.name, None

    def search(self, space):
        self.result = self.inner.search(space)
        return self.result


def run_one(w, mesh, topology, searcher, measure: bool) -> Row:
    recorded = Recorded(searcher)
    step = automap.automap(w.train_step, mesh=mesh, search=recorded, topology=topology, arbiter=None)
    args = w.abstract()
    try:
        plan = step.plan(*args)
    except MemoryBudgetError:
        return Row(chose="nothing fits")
    est = plan.estimate
    row = Row(est.time_s, est.wire_bytes, est.peak_memory_bytes, recorded.result.stats.wall_time_s,
              chose=_moves(plan.notes))
    if measure:
        m = automap.measure(step.lower(*args).compile())
        row.xla_wire, row.xla_mem = m.wire_bytes, m.memory_per_device or math.nan
    return row


def _moves(notes: tuple[str, ...]) -> str:
    """The tactics the search chose, and how many single decisions besides."""
    moves = [n[len("search: "):] for n in notes if n.startswith("search: ")]
    tactics = [m for m in moves if "(" in m and " on '" not in m]
    rest = len(moves) - len(tactics)
    return " + ".join(tactics + ([f"{rest} decision{'s' * (rest > 1)}"] if rest else [])) or "replicated"


def geomean_ratio(rows: dict[str, Row], full: dict[str, Row], attr: str) -> float:
    """Geometric mean over the workloads of ``attr`` against the full chain's (equal: 1, e.g. both 0)."""
    ratios = []
    for k, row in rows.items():
        a, b = getattr(row, attr), getattr(full[k], attr)
        if not (math.isnan(a) or math.isnan(b)):
            ratios.append(1.0 if a == b else a / b if b > 0 else math.inf)
    if not ratios:
        return math.nan
    if math.inf in ratios or 0.0 in ratios:
        return max(ratios) if math.inf in ratios else 0.0
    return math.exp(sum(math.log(x) for x in ratios) / len(ratios))


def _fmt(attr: str, value: float) -> str:
    if math.isnan(value):
        return "-"
    if attr in ("time_s",):
        return f"{value * 1e3:.3f} ms"
    if attr in ("search_s",):
        return f"{value:.2f}"
    return f"{value / 2**20:.2f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--variants", default=None, help="comma-separated variant names (default: all; --variants=-sweep for a leading dash)")
    parser.add_argument("--mesh", default="2x4", help="mesh sizes, e.g. 2x4 (data x model) or 2x2x2 (data x fsdp x model)")
    parser.add_argument("--topology", default="h100-8", help="a Topology preset the plans are estimated on")
    parser.add_argument("--measure", action="store_true", help="also compile each plan and take XLA's measure")
    parser.add_argument("--out", help="also write the markdown to this file")
    args = parser.parse_args(argv)
    every = variants()
    chosen = {k: every[k] for k in (args.variants.split(",") if args.variants else every)}
    if "full" not in chosen:
        chosen = {"full": every["full"], **chosen}
    topology = automap.cost.Topology.preset(args.topology)
    axes = mesh_axes(args.mesh)
    mesh = automap.make_mesh(axes)
    lines: list[str] = []

    def out(line: str = "") -> None:  # printed as it comes, kept for --out
        lines.append(line)
        print(line, flush=True)

    out(f"Generated by `python benchmarks/ablation.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
        f"(mesh {axes}, topology {topology.name}; {'XLA-measured on 8 CPU devices' if args.measure else 'estimates'})")
    out()
    figures = [f for f in FIGURES if args.measure or not f[1].startswith("xla")]
    results: dict[str, dict[str, Row]] = {v: {} for v in chosen}
    for name in args.workloads.split(","):
        w = WORKLOADS[name]()
        out(f"### {name}")
        out()
        out("| variant | " + " | ".join(f[0] for f in figures) + " | plan |")
        out("|---|" + "---:|" * len(figures) + "---|")
        for vname, searcher in chosen.items():
            row = results[vname][name] = run_one(w, mesh, topology, searcher, args.measure)
            out(f"| {vname} | " + " | ".join(_fmt(a, getattr(row, a)) for _, a in figures) + f" | {row.chose} |")
        out()
    out("### Ratio to the full chain (geometric mean over the workloads; > 1: worse or slower)")
    out()
    out("| variant | " + " | ".join(f[0] for f in figures) + " | worse step on |")
    out("|---|" + "---:|" * len(figures) + "---|")
    full = results["full"]
    for vname, rows in results.items():
        worse = [k for k, r in rows.items() if not r.time_s <= full[k].time_s * (1 + 1e-9)]
        out(f"| {vname} | " + " | ".join(f"{geomean_ratio(rows, full, a):.3f}" for _, a in figures)
            + f" | {', '.join(worse) or '-'} |")
    out()
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    code = main()
    print(f"(ran {time.perf_counter() - t0:.0f} s)")
    sys.exit(code)
