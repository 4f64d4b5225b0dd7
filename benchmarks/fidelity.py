"""Plan = program on the corpus and the zoo: the cost model's estimate against what XLA compiles.

For every model (``automap.zoo.corpus`` plus the zoo GPT, unrolled and scanned, and the MLP) on
a data=2 x model=4 mesh of 8 simulated CPU devices (``--mesh 4x2``: data=4 x model=2), and every plan:

- ``default``: automap's default search (``search.MCTS()``; ``--episodes N`` for a shorter one);
- tactic plans, no search filling the axes they leave (as tests/corpus/test_corpus.py plans them):
  ``data_parallel('data')``; ``megatron_dp`` = ``schedule(data_parallel('data'), megatron('model'))``;
  ``fsdp`` over both axes = ``schedule(fsdp('data'), fsdp('model'))``; ``fsdp_tp()`` (data
  parallel, megatron, fsdp on data);
- manual plans, hand-written expert specs pinning every input (``tactics.manual``): ``manual_dp``
  (the batch's dim 0 over ('data', 'model'), or 'data' where 8 does not divide it; the state
  replicated), ``manual_megatron_dp`` (the batch on 'data'; ``zoo.experts.megatron`` for the zoo,
  ``automap.zoo.corpus.megatron_specs`` for the corpus), ``manual_fsdp`` (the batch as DP; each
  parameter and its optimizer moments split along their largest dim 8 divides over ('data', 'model')),

it prints, per model, the three figures of issue 18:

1. fidelity, estimated / XLA: bytes sent per device (``plan.estimate.wire_bytes`` against
   ``automap.measure(compiled).wire_bytes``, ring traffic on both sides, as ``plan.verify``
   compares them), memory per device and dot FLOPs; targets within 10%, 25%, 5%
   (``automap.verify.TOLERANCES``). Under a row outside a target: the collectives
   ``plan.verify(compiled)`` finds most different, with the ops each side has them at, and the
   memory split (arguments + outputs - aliased + temporaries) on both sides.
2. jit parity, for the manual plans: the program automap compiles against
   ``jax.jit(train_step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)``,
   XLA's bytes sent and memory, target <= 1.05x each.
3. not dominated: the default plan against each manual plan by XLA's measure (dominated: more bytes
   sent and more memory than the manual plan).

    python benchmarks/fidelity.py [--models a,b] [--plans p,q] [--quick] [--episodes N] [--mesh DxM]
                                  [--workload FILE.py:FN ...] [--arbiter auto] [--pins anchors]
                                  [--markdown] [--out docs/fidelity.md]

``--workload FILE.py:FN`` (repeatable) adds your own model: ``FN()`` in ``FILE.py`` returns an
:class:`automap.zoo.workload.Workload` (``make_workload`` in :mod:`automap.zoo.train` builds one
from init/loss functions; see ``automap/zoo/corpus`` for flax, equinox and pure-JAX examples); the
row is named ``FN`` and, with ``--models`` not given, only the added workloads run. Its
``manual_megatron_dp`` plan takes :func:`automap.zoo.experts.megatron`'s specs.

``--pins``/``--arbiter`` compare emission policies (e.g. ``--pins anchors --arbiter none``, the
policy before pins by plan decision, against the defaults). ``--markdown`` prints the tables as Markdown; ``--out FILE`` writes them to FILE (committed
results change only when asked). ``--quick``: the MLP and the nnx transformer, 8 episodes.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import math
import os
import re
import sys
import time
from typing import Any, Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)
import jax  # noqa: E402
from jax import tree_util  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
import search  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402
from automap.measure import Measurement, measure  # noqa: E402
from automap.report import human_bytes  # noqa: E402
from automap.trace import path_str  # noqa: E402
from automap.verify import TOLERANCES, Fidelity, op_axes  # noqa: E402
from automap.zoo import corpus  # noqa: E402
from automap.zoo.corpus.megatron_specs import MEGATRON  # noqa: E402

MESH = {"data": 2, "model": 4}
ALL = ("data", "model")
GPT = dict(layers=2, d_model=64, heads=4, vocab=256, seq=16, batch=8)
MODELS: dict[str, Callable[[], Any]] = {
    **corpus.BUILDERS,
    "gpt_linen": lambda: zoo.gpt_linen(zoo.GPTConfig(**GPT)),
    "gpt_linen_scan": lambda: zoo.gpt_linen(zoo.GPTConfig(scan=True, **GPT)),
    "mlp": lambda: zoo.mlp(zoo.MLPConfig(d_in=64, hidden=(256, 256), d_out=64, batch=8)),
}
QUICK_MODELS, QUICK_EPISODES = ("mlp", "nnx_transformer"), 8
TACTICS = ("data_parallel", "megatron_dp", "fsdp", "fsdp_tp")
MANUAL = ("manual_dp", "manual_megatron_dp", "manual_fsdp")
PLANS = ("default",) + TACTICS + MANUAL
PARITY = 1.05  # automap's bytes sent and memory at most this times jax.jit's with the same in_shardings


# --- the plans ------------------------------------------------------------------------------------


def _size(axes) -> int:
    return math.prod(MESH[a] for a in (axes if isinstance(axes, tuple) else (axes,)))


def _batch_dim0(candidates: tuple) -> Callable[[tuple], P]:
    """A batch leaf's spec: dim 0 over the first of `candidates` whose size divides it."""
    def spec(shape: tuple) -> P:
        fit = [a for a in candidates if shape and shape[0] % _size(a) == 0]
        return P(fit[0], *[None] * (len(shape) - 1)) if fit else P()
    return spec


def _fsdp_spec(shape: tuple) -> P:
    """The largest dim (first on ties) that 8 divides, over both axes; replicated if none."""
    dims = [d for d, n in enumerate(shape) if n % _size(ALL) == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda d: (shape[d], -d))
    return P(*[ALL if d == best else None for d in range(len(shape))])


def _leaves(tree: Any) -> dict[str, tuple]:
    """Leaf path (as automap writes input paths, without the argument's name) -> shape."""
    return {path_str("", p): tuple(leaf.shape) for p, leaf in tree_util.tree_flatten_with_path(tree)[0]}


def _rules(params: dict[str, P], state: Any, batch: Any, batch_spec: Callable[[tuple], P]) -> list[tuple[str, P]]:
    """Manual rules pinning every input: each parameter and each optimizer-state leaf of its shape
    under the same path suffix (Adam's moments; not Adafactor's factored rows and columns, nor a
    scalar count), the longest suffix first; the rest of the state replicated; each batch leaf."""
    shapes = _leaves(state["params"])
    by_length = sorted(params.items(), key=lambda kv: -len(kv[0]))
    rules = []
    for leaf, shape in _leaves(state).items():
        owner = next((path for path, _ in by_length if leaf == path or leaf.endswith("/" + path)), None)
        if owner is not None and shapes.get(owner) == shape:
            rules.append(("^state/" + re.escape(leaf) + "$", params[owner]))
    rules.append(("^state/", P()))
    return rules + [("^batch/" + re.escape(path) + "$", batch_spec(shape)) for path, shape in _leaves(batch).items()]


def _megatron_params(name: str, w: Any, mesh: Any) -> dict[str, P]:
    state, batch = w.abstract()
    params = _leaves(state["params"])
    if name in MEGATRON:
        return {path: MEGATRON[name].get(path, P()) for path in params}
    specs = zoo.experts.megatron(state, batch, mesh)[0]["params"]
    flat = tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, P))[0]
    return {path_str("", p): s for p, s in flat}


def manual_rules(name: str, w: Any, mesh: Any) -> dict[str, list[tuple[str, P]]]:
    """The hand-written expert plans of model `name`: plan name -> manual rules."""
    state, batch = w.abstract()
    params = _leaves(state["params"])
    dp = _batch_dim0((ALL, "data"))
    return {
        "manual_dp": _rules({p: P() for p in params}, state, batch, dp),
        "manual_megatron_dp": _rules(_megatron_params(name, w, mesh), state, batch, _batch_dim0(("data",))),
        "manual_fsdp": _rules({p: _fsdp_spec(s) for p, s in params.items()}, state, batch, dp),
    }


def plan_options(plan: str, manual: dict[str, list], episodes: int | None) -> dict[str, Any]:
    """Keyword arguments of ``automap.automap`` for one plan."""
    dp = tactics.data_parallel("data")
    schedules = {
        "data_parallel": dp, "megatron_dp": tactics.schedule(dp, tactics.megatron("model")),
        "fsdp": tactics.schedule(tactics.fsdp("data"), tactics.fsdp("model")), "fsdp_tp": tactics.fsdp_tp(),
    }
    if plan == "default":
        return {} if episodes is None else dict(search=search.MCTS(episodes=episodes, seed=0))
    if plan in schedules:
        return dict(tactics=[schedules[plan]], search=None)
    return dict(tactics=[tactics.manual(manual[plan])], search=None)


# --- measuring ------------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    """One (model, plan): the plan's fidelity, and for manual plans jax.jit's measure of the same
    in/out shardings."""

    model: str
    plan: str
    fid: Fidelity | None = None
    estimate: Any = None
    jit: Measurement | None = None
    seconds: float = 0.0
    error: str = ""

    def ratios(self) -> dict[str, float]:
        """estimated / XLA per figure (verify's Figure.ratio is the inverse)."""
        return {f.name: _ratio(f.estimated, f.measured) for f in self.fid.figures}

    def outside(self) -> list[str]:
        return [name for name, r in self.ratios().items() if not abs(r - 1) <= TOLERANCES[name]]

    def parity(self) -> dict[str, float]:
        """automap's / jax.jit's measured bytes sent and memory (manual plans only)."""
        m = self.fid.measurement
        return {"bytes sent": _ratio(m.wire_bytes, self.jit.wire_bytes),
                "memory": _ratio(m.memory_per_device, self.jit.memory_per_device)}

    @property
    def sent(self) -> float:
        return self.fid.measurement.wire_bytes

    @property
    def memory(self) -> int:
        return self.fid.measurement.memory_per_device


def _ratio(a: float, b: float) -> float:
    if b == 0:
        return 1.0 if a == 0 else math.inf
    return a / b


def measure_row(name: str, plan_name: str, w: Any, args: tuple, options: dict, automap_options: dict) -> Row:
    """``automap_options``: ``pins``/``arbiter`` when given on the command line, else automap's defaults."""
    row = Row(name, plan_name)
    start = time.perf_counter()
    try:
        step = automap.automap(w.train_step, mesh=automap.make_mesh(MESH), **automap_options, **options)
        plan = step.plan(*args)
        row.estimate = plan.estimate
        row.fid = plan.verify(step.lower(*args).compile(), warn=False)
        if plan_name in MANUAL:
            ref = jax.jit(w.train_step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)
            row.jit = measure(ref.lower(*args).compile())
    except Exception as e:  # a failing plan is a row of the table, not the end of the benchmark
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    row.seconds = time.perf_counter() - start
    return row


def dominated(default: Row, other: Row) -> bool:
    """The default plan sends more bytes and takes more memory than `other`, by XLA's measure."""
    return default.sent > other.sent and default.memory > other.memory


# --- output ---------------------------------------------------------------------------------------


def _fmt(figure: str, n: float) -> str:
    return f"{n:.3g}" if figure == "dot FLOPs" else human_bytes(n)


def _ops(label: str) -> list[str]:
    """An HLO op_name without the jit prefix; a combined collective's ``jit(fn)/(a:b:c)`` is its parts."""
    label = re.sub(r"^jit\([^)]*\)/", "", label)
    if label.startswith("(") and label.endswith(")") and ":" in label:
        return label[1:-1].split(":")
    return [label]


def _where(names: tuple[str, ...], n: int = 3) -> str:
    counts = collections.Counter(part for s in names for part in _ops(s))
    shown = [f"{k} x{c}" if c > 1 else k for k, c in counts.most_common(n)]
    return ", ".join(shown) + (f" (+{len(counts) - n} more)" if len(counts) > n else "") if shown else "-"


def diagnosis(row: Row, top: int = 3) -> list[str]:
    """Why a row is outside its targets: the most different collectives and the memory split."""
    lines, outside = [], row.outside()
    if "bytes sent" in outside:  # collectives by kind and axes, the most different first
        diff = sorted(row.fid.collectives, key=lambda r: -abs(r.measured_bytes - r.estimated_bytes))
        for r in diff[:top]:
            if r.measured_bytes == r.estimated_bytes:
                continue
            lines.append(f"{r.kind} over {'+'.join(r.axes) or '-'}: estimated {r.estimated_count}x "
                         f"{human_bytes(r.estimated_bytes)}, XLA {r.measured_count}x {human_bytes(r.measured_bytes)}; "
                         f"plan at {_where(r.expected_at)}; XLA at {_where(r.emitted_at)}")
    if "memory" in outside and row.fid.measurement.memory is not None:
        e, m = row.estimate.memory, row.fid.measurement.memory
        lines.append(f"memory estimated args {human_bytes(e.arguments)} + out {human_bytes(e.outputs)} - alias "
                     f"{human_bytes(e.aliased)} + temp {human_bytes(e.temp)}; XLA args {human_bytes(m.argument)} + out "
                     f"{human_bytes(m.output)} - alias {human_bytes(m.alias)} + temp {human_bytes(m.temp)}")
    if "dot FLOPs" in outside:
        f = row.fid.dot_flops
        lines.append(f"dot FLOPs estimated {f.estimated:.4g}, XLA {f.measured:.4g}")
    if row.jit is not None and max(row.parity().values()) > PARITY:
        ours, theirs = row.fid.measurement, row.jit
        lines.append(f"vs jax.jit: automap {_collectives(ours)}, temp {human_bytes(ours.memory.temp)}; "
                     f"jax.jit {_collectives(theirs)}, temp {human_bytes(theirs.memory.temp)}")
    return lines


def _code(line: str) -> str:
    """A diagnosis line for Markdown: op names (they hold underscores and parentheses) as code."""
    return re.sub(r"((?:plan|XLA) at )([^;]+)", lambda m: m.group(1) + "`" + m.group(2).strip() + "`", line)


def _collectives(m: Measurement) -> str:
    """Bytes sent per collective kind and mesh axes, largest first."""
    sent: dict[str, float] = collections.Counter()
    for op in m.ops:
        sent[f"{op.kind} {'+'.join(op_axes(op, MESH)) or '-'}"] += op.wire_bytes
    return ", ".join(f"{k} {human_bytes(v)}" for k, v in sorted(sent.items(), key=lambda kv: -kv[1]) if v) or "nothing"


def _mark(text: str, bad: bool, markdown: bool) -> str:
    """A figure outside its target: bold in Markdown, a trailing star on the console."""
    return text if not bad else f"**{text}**" if markdown else text + "*"


def table(rows: list[Row], markdown: bool) -> list[str]:
    """One model's table: per plan the three figures (estimated, XLA, est/XLA), jit parity,
    whether this manual plan dominates the default plan, the estimated step time (what the search
    minimises) and the seconds planning and compiling took."""
    default = next((r for r in rows if r.plan == "default" and not r.error), None)
    head = ["plan", "bytes sent est / XLA", "ratio", "memory est / XLA", "ratio", "dot FLOPs est / XLA", "ratio",
            "vs jax.jit sent / mem", "dominates default", "est. time", "s"]
    body = []
    for r in rows:
        if r.error:
            body.append([r.plan, "error: " + r.error] + [""] * (len(head) - 3) + [f"{r.seconds:.0f}"])
            continue
        cells = [r.plan]
        for f, ratio in zip(r.fid.figures, r.ratios().values(), strict=True):
            cells += [f"{_fmt(f.name, f.estimated)} / {_fmt(f.name, f.measured)}",
                      _mark(f"{ratio:.2f}", abs(ratio - 1) > TOLERANCES[f.name], markdown)]
        if r.jit is not None:
            cells.append(" / ".join(_mark(f"{v:.2f}", v > PARITY, markdown) for v in r.parity().values()))
            cells.append("-" if default is None else _mark("yes", True, markdown) if dominated(default, r) else "no")
        else:
            cells += ["", ""]
        body.append(cells + [f"{r.estimate.time_s * 1e6:.0f} us", f"{r.seconds:.0f}"])
    if markdown:
        return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(c) + " |" for c in body]
    widths = [max(len(str(c[i])) for c in [head] + body) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) for cells in [head] + body]


def summary(rows: list[Row]) -> list[str]:
    """One line per criterion: how many rows are outside its target."""
    ok = [r for r in rows if not r.error]
    lines = [f"fidelity ({len(ok)} plans; estimated / XLA): " + ", ".join(
        f"{name} outside {tol:.0%}: {sum(name in r.outside() for r in ok)}" for name, tol in TOLERANCES.items())]
    manual = [r for r in ok if r.jit is not None]
    lines.append(f"jit parity ({len(manual)} manual plans; automap / jax.jit, target <= {PARITY}x): "
                 f"bytes sent above: {sum(r.parity()['bytes sent'] > PARITY for r in manual)}, "
                 f"memory above: {sum(r.parity()['memory'] > PARITY for r in manual)}")
    pairs = [(d, r) for d in ok if d.plan == "default" for r in manual if r.model == d.model]
    lines.append(f"not dominated ({len(pairs)} default vs manual pairs, XLA's measure): default dominated in "
                 f"{sum(dominated(d, r) for d, r in pairs)}"
                 + "".join(f"; {d.model} by {r.plan}" for d, r in pairs if dominated(d, r)))
    if len(ok) < len(rows):
        lines.append(f"errors: {len(rows) - len(ok)} plans failed: "
                     + ", ".join(f"{r.model}/{r.plan}" for r in rows if r.error))
    return lines


def run(models: list[str], plans: list[str], episodes: int | None, automap_options: dict,
        markdown: bool, out: str | None) -> list[Row]:
    rows: list[Row] = []
    doc = ["# Fidelity: the estimate against what XLA compiles", "",
           f"Generated by `python benchmarks/fidelity.py {' '.join(sys.argv[1:])}` (mesh {_mesh_words(MESH)}, "
           "8 simulated CPU devices). Ratios are estimated / XLA for the figures and automap / `jax.jit` for "
           f"the parity column; **bold** is outside its target (bytes sent 10%, memory 25%, dot FLOPs 5%, "
           f"parity <= {PARITY}x).", "",
           "Plans: `default` is automap's default search; `data_parallel`, `megatron_dp` "
           "(`schedule(data_parallel('data'), megatron('model'))`), `fsdp` (`schedule(fsdp('data'), "
           "fsdp('model'))`) and `fsdp_tp` (`tactics.fsdp_tp()`) are tactic plans without a search; the "
           "`manual_*` plans pin every input to a hand-written expert spec (`tactics.manual`), see the "
           "docstring of `benchmarks/fidelity.py`. Bytes sent are ring traffic per device (`wire_bytes`) on "
           "both sides. *dominates default*: this manual plan sends fewer bytes and takes less memory than "
           "the default plan (XLA's measure). *est. time*: the cost model's step time, what the search "
           "minimises. Under each table, the collectives `plan.verify` finds most different (estimated and "
           "XLA's count and bytes sent, the ops each side has them at) and the memory split of the rows "
           "outside a target.", ""]
    t0 = time.time()
    for name in models:
        w = MODELS[name]()
        args = w.abstract()
        manual = manual_rules(name, w, automap.make_mesh(MESH)) if set(plans) & set(MANUAL) else {}
        print(f"\n== {name}", flush=True)
        mine = []
        for plan in plans:
            row = measure_row(name, plan, w, args, plan_options(plan, manual, episodes), automap_options)
            mine.append(row)
            print(f"  {plan}: {row.error or ', '.join(f'{k} {v:.2f}' for k, v in row.ratios().items())} "
                  f"({row.seconds:.0f} s)", flush=True)
        rows += mine
        print("\n".join(table(mine, markdown=False)))
        doc += [f"## {name}", ""] + table(mine, markdown=True) + [""]
        for r in mine:
            why = [] if r.error else diagnosis(r)
            if why:
                print(f"  {r.plan} outside target:\n    " + "\n    ".join(why))
                doc += [f"- {r.plan} outside target:"] + [f"  - {_code(line)}" for line in why]
        doc.append("")
    lines = summary(rows)
    print(f"\n{len(rows)} plans in {time.time() - t0:.0f} s\n" + "\n".join(lines))
    doc += ["## Summary", ""] + [f"- {line}" for line in lines] + [""]
    if markdown:
        print("\n" + "\n".join(doc))
    if out:
        with open(out, "w") as f:
            f.write("\n".join(doc))
        print(f"wrote {out}")
    return rows


def mesh_arg(text: str) -> dict[str, int]:
    """``--mesh DxM`` -> the mesh {'data': D, 'model': M} (the axes the plans name).

    >>> mesh_arg("4x2")
    {'data': 4, 'model': 2}
    >>> mesh_arg("8")
    Traceback (most recent call last):
    ...
    ValueError: --mesh wants DATAxMODEL with 8 devices in all (e.g. 2x4, 4x2, 8x1), got '8'
    """
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts) or math.prod(map(int, parts)) != 8:
        raise ValueError(f"--mesh wants DATAxMODEL with 8 devices in all (e.g. 2x4, 4x2, 8x1), got {text!r}")
    return {"data": int(parts[0]), "model": int(parts[1])}


def _mesh_words(mesh: dict[str, int]) -> str:
    return " x ".join(f"{a}={n}" for a, n in mesh.items())


def load_workload(where: str) -> tuple[str, Callable[[], Any]]:
    """``FILE.py:FN`` -> (``FN``, the builder ``FN`` of that file), for ``--workload``.

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
    ...     _ = f.write("def tiny():\\n    return 'a workload'\\n")
    >>> name, build = load_workload(f.name + ":tiny")
    >>> name, build()
    ('tiny', 'a workload')
    """
    import importlib.util

    path, sep, fn = where.rpartition(":")
    if not sep or not path.endswith(".py") or not fn.isidentifier():
        raise ValueError(f"--workload wants FILE.py:FUNCTION, got {where!r}")
    spec = importlib.util.spec_from_file_location(f"workload_{fn}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"--workload: cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses and pickling look the module up
    spec.loader.exec_module(module)
    build = getattr(module, fn, None)
    if not callable(build):
        raise ValueError(f"--workload: {path!r} has no function {fn!r}")
    return fn, build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--plans", help=f"comma-separated, from {', '.join(PLANS)} (default: all)")
    parser.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK_MODELS)}; {QUICK_EPISODES} episodes")
    parser.add_argument("--episodes", type=int, help="MCTS episodes of the default plan (default: search.MCTS()'s)")
    parser.add_argument("--arbiter", choices=("none", "auto", "always", "search"),
                        help="automap's arbiter option (default: automap's)")
    parser.add_argument("--pins", choices=("plan", "anchors", "all", "none"),
                        help="automap's pin policy, automap.emit.pinned_values (default: automap's)")
    parser.add_argument("--workload", action="append", default=[], metavar="FILE.py:FN",
                        help="add a model: FN() in FILE.py returns a Workload (repeatable)")
    parser.add_argument("--mesh", default="2x4", help="DATAxMODEL, 8 devices in all (default 2x4)")
    parser.add_argument("--markdown", action="store_true", help="print the tables as Markdown too")
    parser.add_argument("--out", help="write the Markdown tables to this file")
    args = parser.parse_args(argv)
    try:
        MESH.clear()  # read by every function here: the mesh the plans are made and compiled on
        MESH.update(mesh_arg(args.mesh))
    except ValueError as e:
        parser.error(str(e))
    added = dict(load_workload(w) for w in args.workload)
    MODELS.update(added)
    models = (args.models.split(",") if args.models else list(added) if added
              else list(QUICK_MODELS if args.quick else MODELS))
    plans = args.plans.split(",") if args.plans else list(PLANS)
    for given, known in ((models, MODELS), (plans, PLANS)):
        unknown = [x for x in given if x not in known]
        if unknown:
            parser.error(f"unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    episodes = args.episodes if args.episodes is not None else QUICK_EPISODES if args.quick else None
    automap_options = {} if args.pins is None else {"pins": args.pins}
    if args.arbiter is not None:
        automap_options["arbiter"] = None if args.arbiter == "none" else args.arbiter
    run(models, plans, episodes, automap_options, args.markdown, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
