"""Issue 21's expert-parallel done-when measured: on GShard-style top-2 MoEs (corpus
``moe_einsum``) and the dropless top-1 MoE (``moe_ragged``: tokens sorted by expert over the
whole batch, ``jax.lax.ragged_dot``), mesh data=2 x model=4 on 8 simulated CPU devices, the
default plan (no tactics, the default search and arbiter) against the hand-written
expert-parallel plans, side by side by XLA's measure (wire bytes sent and memory per device,
XLA:CPU with the test suite's fast options), each sharded loss held against the unsharded step.

Hand-written plans (``tactics.manual``), the expert weights and their Adam moments split on their
expert dim over ``model``: on the GShard MoE the batch over ``data`` (``hand EP, batch on data``:
the tests' plan) and over both axes where it divides (``hand EP, batch on both``); on the ragged
MoE, whose global sort gathers every token, the batch left whole (``hand EP, batch whole``) and
over ``data``. The reference is the first, unless :func:`automap.arbiter.prefer` keeps another
over it. The tactic plans ``dp + expert_parallel`` (GShard's layout: the tokens over the expert
axis too) and ``dp + expert_parallel + megatron`` are printed beside them.

    python benchmarks/moe_expert.py [--configs tiny,batch-8,...] [--topology h100-8]
    python benchmarks/moe_expert.py --workload FILE.py:FN [--experts REGEX]

``--workload`` measures a model from elsewhere (``FN()`` returns a workload, as for
``fidelity.py --workload``) in place of the corpus: its expert weights are the inputs whose path
matches ``--experts`` (default ``expert``; each match must lead with the expert count, which
'model' divides), its batch split as the GShard MoE's (over ``data``, and over both axes where
the leading dim of the first batch leaf allows).

Where the default holds more memory than that reference (it trades memory for step time: every
plan fits the 4 GiB budget), the default is planned again with the reference's memory per device as
its ``memory_budget`` and measured beside it: what automap makes of a model whose memory matters.

``--topology`` plans the default under a preset (the figures stay XLA:CPU's); the default is the
topology ``automap`` picks for the devices (``cpu-sim`` here). Nothing is written to disk.
"""
import argparse
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
import search  # noqa: E402,F401  (before the benchmarks folder joins the path: --workload)
import tactics  # noqa: E402
from automap.arbiter import prefer  # noqa: E402
from automap.measure import Measurement  # noqa: E402
from automap.zoo.corpus.moe import MoEConfig, moe_einsum, moe_ragged  # noqa: E402

AXES = {"data": 2, "model": 4}
MID = dict(vocab=512, seq=64, d_model=256, hidden=1024, experts=8, batch=16)  # compute outweighs latency
CONFIGS = {  # (model, MoEConfig fields); "tiny" is the corpus default (tests/search/test_expert_macros.py)
    "tiny": ("einsum", dict()),
    "batch-8": ("einsum", dict(batch=8)),
    "experts-8": ("einsum", dict(experts=8, batch=8)),
    "capacity-1": ("einsum", dict(capacity_factor=1.0, batch=8)),
    "wide": ("einsum", dict(experts=8, d_model=64, hidden=128, capacity_factor=1.25, batch=8, seq=16)),
    "mid": ("einsum", MID),
    "ragged-tiny": ("ragged", dict()),
    "ragged-batch-8": ("ragged", dict(batch=8)),
    "ragged-mid": ("ragged", MID),
}
MODELS = {"einsum": moe_einsum, "ragged": moe_ragged}
FAST = {  # as the tests compile: XLA:CPU without optimisation passes (the SPMD partitioner runs all the same)
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
    "xla_cpu_use_fusion_emitters": False,
}
EXPERTS = r"w_in$|w_out$"  # the corpus MoEs' expert weights (and their Adam moments)
HAND = "hand EP, "


def plans(experts: str, batch_size: int, ragged: bool, topology) -> dict[str, dict]:
    """name -> keywords of :func:`automap.partition`: the hand-written plans (the reference first;
    ``experts`` a regex of the expert weights' and their moments' input paths, split on dim 0 over
    'model'), the tactic plans, the default."""
    dp, ep = tactics.data_parallel("data"), tactics.expert_parallel("model")
    fixed = dict(search=None, arbiter=None)
    batch = {"data": P("data"), "both": P(("data", "model")), "whole": None}
    ways = ["data"] + (["both"] if batch_size % (AXES["data"] * AXES["model"]) == 0 else [])
    if ragged:  # the global sort gathers every token: the batch left whole, or over data
        ways = ["whole", "data"]
    out = {}
    for way in ways:
        rules = {experts: P("model"), **({r"^batch/": batch[way]} if batch[way] else {})}
        label = HAND + ("batch whole" if way == "whole" else f"batch on {way}")
        out[label] = dict(tactics=[tactics.manual(rules)], **fixed)
    out["dp + expert_parallel"] = dict(tactics=[dp, ep], **fixed)
    out["dp + expert_parallel + megatron"] = dict(tactics=[dp, ep, tactics.megatron("model")], **fixed)
    out["default"] = {} if topology is None else dict(topology=automap.Topology.preset(topology))
    return out


def expert_leaves(plan, experts: str) -> str:
    """What ``experts`` matches among the plan's inputs (count, shapes), checked: every match
    leads with the same expert count, divisible by 'model'."""
    hits = [(p, a.shape) for p, a in zip(plan.program.input_paths, plan.traced.in_avals) if re.search(experts, p)]
    counts = {shape[0] if shape else None for _, shape in hits}
    if len(counts) != 1 or None in counts or next(iter(counts)) % AXES["model"]:
        raise SystemExit(f"--experts {experts!r}: the matches must all lead with one expert count divisible by "
                         f"{AXES['model']}; matched {hits}")
    shapes = sorted({str(shape) for _, shape in hits})
    return f"{len(hits)} inputs match {experts!r} ({next(iter(counts))} experts; shapes {', '.join(shapes)})"


def measure_config(name: str, topology) -> str:
    """Print one corpus configuration's rows; returns the verdict (see :func:`measure_workload`)."""
    model, fields = CONFIGS[name]
    cfg = MoEConfig(**fields)
    fields_text = ", ".join(f"{k}={v}" for k, v in fields.items())
    return measure_workload(f"{name}: moe_{model}(MoEConfig({fields_text}))", MODELS[model](cfg), EXPERTS,
                            cfg.batch, model == "ragged", topology)


def measure_workload(title: str, w, experts: str, batch_size: int, ragged: bool, topology) -> str:
    """Print one workload's rows; returns the verdict (default against the better hand-written plan)."""
    state, batch = w.init(0)
    mesh = automap.make_mesh(AXES)
    want = float(jax.jit(w.train_step)(state, batch)[1])
    print(f"\n{title}, mesh data=2 x model=4")
    got, kept = {}, ""
    for label, kw in plans(experts, batch_size, ragged, topology).items():
        t0 = time.perf_counter()
        step = automap.partition(w.train_step, mesh=mesh, **kw)
        plan = step.plan(state, batch)
        if not got:
            print(f"  expert weights: {expert_leaves(plan, experts)}")
        compiled = step.lower(state, batch).compile(FAST)
        m = got[label] = automap.measure(compiled)
        outs = compiled(*jax.tree.leaves(jax.device_put((state, batch), plan.in_shardings)))
        loss = float(jax.tree_util.tree_unflatten(plan.traced.out_tree, outs)[1])
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        print(f"  {label:<34} wire {m.wire_bytes:>11,.0f} B  memory {m.memory_per_device:>11,} B  "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
        if label == "default":
            kept = next((n.split("; measured")[0] for n in plan.notes if n.startswith("search arbiter")), "")
            kept = kept or "; ".join(n for n in plan.notes if n.startswith("search: ") and "held" not in n)
    best = reference({k: m for k, m in got.items() if k.startswith(HAND)})
    wire, memory, said = verdict(got["default"], got[best])
    print(f"  default / better hand-written ({best}): wire {wire:.3f}x, memory {memory:.3f}x: {said}")
    print(f"  default plan: {kept}")
    if memory > 1:  # the default trades memory for time; under the hand plan's memory as budget:
        budget = got[best].memory_per_device
        default = plans(experts, batch_size, ragged, topology)["default"]
        step = automap.partition(w.train_step, mesh=mesh, memory_budget=budget, **default)
        plan = step.plan(state, batch)
        m = automap.measure(step.lower(state, batch).compile(FAST))
        wire, memory, budgeted = verdict(m, got[best])
        print(f"  default, memory_budget={budget:,} B (the hand plan's): wire {m.wire_bytes:,.0f} B, memory "
              f"{m.memory_per_device:,} B: {wire:.3f}x / {memory:.3f}x: {budgeted}")
        said += f"; with the hand plan's memory as budget: {budgeted}"
    return said


def reference(hands: dict[str, Measurement]) -> str:
    """The better hand-written plan: the first, unless :func:`automap.arbiter.prefer` keeps a later one."""
    names = list(hands)
    best = names[0]
    for name in names[1:]:
        if prefer(hands[best], hands[name]):
            best = name
    return best


def verdict(default: Measurement, hand: Measurement) -> tuple[float, float, str]:
    """(wire ratio, memory ratio, what they say) of the default plan against the hand-written one.

    >>> from automap.measure import CollectiveOp, MemoryStat
    >>> def m(sent, memory):
    ...     op = CollectiveOp("all-gather", 2 * sent, 1, [[0, 1]], "ag", "main", group_size=2)
    ...     return Measurement({}, MemoryStat(memory, 0, 0, 0), 0, [op] if sent else [])
    >>> verdict(m(90, 100), m(100, 100))[2], verdict(m(110, 120), m(100, 100))[2]
    ('<= in both', 'DOMINATED')
    >>> verdict(m(90, 101), m(100, 100))[2]  # within MEMORY_SLACK: the arbiter would keep the default
    'fewer bytes, more memory (arbiter.prefer: the default)'
    >>> verdict(m(0, 300), m(100, 100))[2]
    'fewer bytes, more memory (arbiter.prefer: neither)'
    """
    wire = default.wire_bytes / max(hand.wire_bytes, 1)
    memory = default.memory_per_device / hand.memory_per_device
    if wire <= 1 and memory <= 1:
        return wire, memory, "<= in both"
    if wire > 1 and memory > 1:
        return wire, memory, "DOMINATED"
    kept = "the default" if prefer(hand, default) else "the hand-written plan" if prefer(default, hand) else "neither"
    trade = "fewer bytes, more memory" if wire <= 1 else "less memory, more bytes"
    return wire, memory, f"{trade} (arbiter.prefer: {kept})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--topology", default=None, help="a Topology preset the default plan is searched under")
    parser.add_argument("--workload", metavar="FILE.py:FN", help="this model in place of the corpus configurations")
    parser.add_argument("--experts", default="expert", metavar="REGEX",
                        help="--workload: the expert weights' input paths (their Adam moments too), split on dim 0")
    args = parser.parse_args()
    t0 = time.perf_counter()
    if args.workload:
        sys.path.append(os.path.dirname(os.path.abspath(__file__)))  # after the imports of search, tactics
        from fidelity import load_workload

        name, build = load_workload(args.workload)
        w = build()
        batch_size = jax.tree.leaves(w.abstract()[1])[0].shape[0]
        verdicts = {name: measure_workload(name, w, args.experts, batch_size, False, args.topology)}
    else:
        verdicts = {name: measure_config(name, args.topology) for name in args.configs.split(",")}
    names = list(verdicts)
    met = [n for n, v in verdicts.items() if v == "<= in both"]
    budgeted = [n for n, v in verdicts.items() if v.endswith("budget: <= in both")]
    print(f"\ndefault <= the better hand-written expert plan in bytes and memory: {len(met)} of {len(names)} "
          f"({', '.join(met)}); the others: " + "; ".join(f"{n}: {v}" for n, v in verdicts.items() if n not in met))
    if len(met) < len(names):
        print(f"with the better hand-written plan's memory as the default's memory_budget: {len(budgeted)} of "
              f"{len(names) - len(met)} others <= in both")
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
