"""Emission against ``jax.jit``: per pin policy, what XLA compiles of a plan, and how it compares
with ``jax.jit`` given the same input (and output) shardings.

For the zoo GPT and every corpus model on a data=2 x model=4 mesh, each plan (automap's default
plan, the tactic plans, and the experts' exact input specs: DP, FSDP over both axes, Megatron + DP)
is compiled under each pin policy (:func:`automap.emit.pinned_values`) and measured
(:func:`automap.measure`). Prints per row: the estimate (bytes sent, memory per device), XLA's
measure, the ratios measured / estimated, and for the expert specs the ratios to ``jax.jit``
(the issue's target: <= 1.05 in bytes sent and memory). Compile seconds are per program.

    python benchmarks/jit_parity.py [--models gpt,linen_resnet] [--plans fsdp-specs,...]
                                    [--policies anchors,plan,none] [--csv out.csv]
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import sys
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401
import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import automap  # noqa: E402
import search  # noqa: E402
import tactics  # noqa: E402
from automap import emit, zoo  # noqa: E402
from automap.zoo import corpus  # noqa: E402

MESH = {"data": 2, "model": 4}
BOTH = ("data", "model")


def workload(name):
    if name == "gpt":
        return zoo.gpt_linen(zoo.GPTConfig())
    return corpus.BUILDERS[name]()


def _megatron_table(name):
    if name == "gpt":
        return None
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "corpus"))
    from test_corpus import MODELS  # noqa: PLC0415  (the Megatron specs the corpus test checks)

    return MODELS[name][0]


def _paths(fn, args, mesh):
    plan = automap.partition(fn, mesh=mesh, tactics=[], search=None).plan(*args)
    return [(p, plan.program.values[v].shape) for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)]


def _batch_spec(shape):
    return P("data") if shape and shape[0] % MESH["data"] == 0 else P()


def expert_rules(name, kind, paths, w, mesh):
    """Exact specs for every input (regex on the full path)."""
    specs = {}
    if kind == "megatron" and name == "gpt":
        state, batch = w.abstract()
        ss, bs = zoo.experts.megatron(state, batch, mesh)
        flat = jax.tree_util.tree_flatten_with_path((ss, bs), is_leaf=lambda s: isinstance(s, P))[0]
        by_path = {"/".join(("state", "batch")[kp[0].idx:kp[0].idx + 1] + tuple(str(getattr(k, "key", getattr(k, "idx", k)))
                                                                             for k in kp[1:])): s for kp, s in flat}
        specs = {p: by_path.get(p, P()) for p, _ in paths}
    table = _megatron_table(name) if kind == "megatron" else None
    for path, shape in paths:
        if path in specs:
            continue
        if path.startswith("batch/"):
            specs[path] = _batch_spec(shape)
        elif kind == "fsdp" and shape:
            dims = sorted((d for d in range(len(shape)) if shape[d] % 8 == 0), key=lambda d: -shape[d])
            specs[path] = P(*[BOTH if d == dims[0] else None for d in range(len(shape))]) if dims else P()
        elif kind == "megatron" and table:
            hit = next((s for k, s in table.items() if path.endswith("/" + k) and len(s) <= len(shape)), None)
            specs[path] = hit if hit is not None else P()
        else:
            specs[path] = P()
    return [("^" + re.escape(p) + "$", s) for p, s in specs.items()]


def plans(name, w, args, mesh, wanted):
    fn = w.train_step
    paths = None
    for plan_name in wanted:
        if plan_name.endswith("-specs"):
            paths = paths or _paths(fn, args, mesh)
            rules = expert_rules(name, plan_name[:-len("-specs")], paths, w, mesh)
            yield plan_name, dict(tactics=[tactics.manual(rules)], search=None)
        elif plan_name == "default":
            yield plan_name, dict(search=search.MCTS(episodes=8, seed=0))
        elif plan_name == "dp":
            yield plan_name, dict(tactics=[tactics.data_parallel("data")], search=None)
        elif plan_name == "megatron":
            yield plan_name, dict(tactics=[tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))],
                                  search=None)
        elif plan_name == "fsdp":
            yield plan_name, dict(tactics=[tactics.fsdp("data")], search=None)


def compile_measured(jitted, args):
    start = time.perf_counter()
    compiled = jitted.lower(*args).compile()
    return automap.measure(compiled), time.perf_counter() - start


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="gpt," + ",".join(corpus.BUILDERS))
    ap.add_argument("--plans", default="dp-specs,fsdp-specs,megatron-specs,default,dp,megatron,fsdp")
    ap.add_argument("--policies", default="anchors,plan,none")
    ap.add_argument("--csv")
    a = ap.parse_args(argv)
    mesh = automap.make_mesh(MESH)
    rows = []
    head = (f"{'model':<16}{'plan':<15}{'pins':<8}{'#pins':>6}{'est sent':>10}{'XLA sent':>10}{'ratio':>7}"
            f"{'est mem':>10}{'XLA mem':>10}{'ratio':>7}{'/jit sent':>10}{'/jit mem':>9}{'compile s':>10}")
    print(head, flush=True)
    for name in a.models.split(","):
        w = workload(name)
        state, batch = w.init(0)
        args = (state, batch)
        for plan_name, options in plans(name, w, args, mesh, a.plans.split(",")):
            step = automap.partition(w.train_step, mesh=mesh, **options)
            plan = step.plan(*args)
            est = plan.estimate
            flat = jax.tree.leaves(args)
            outs = plan._flat_out_shardings()
            ref = None
            if plan_name.endswith("-specs"):
                jitted = jax.jit(w.train_step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)
                ref, secs = compile_measured(jitted, args)
                rows.append(dict(model=name, plan=plan_name, pins="jit", n=0, est_sent=est.wire_bytes,
                                 sent=ref.wire_bytes, est_mem=est.peak_memory_bytes, mem=ref.memory_per_device,
                                 jit_sent=1.0, jit_mem=1.0, secs=secs))
                _print(rows[-1])
            seen = {}  # pins -> (measure, seconds): a policy pinning the same values compiles the same
            for policy in a.policies.split(","):
                pins = emit.pinned_values(plan.state, policy)
                if pins not in seen:
                    jitted = emit.compile_plan(plan.state, mesh, pins=pins, out_specs=outs)
                    seen[pins] = compile_measured(jitted, flat)
                m, secs = seen[pins]
                row = dict(model=name, plan=plan_name, pins=policy, n=len(pins), est_sent=est.wire_bytes,
                           sent=m.wire_bytes, est_mem=est.peak_memory_bytes, mem=m.memory_per_device,
                           jit_sent=_ratio(m.wire_bytes, ref.wire_bytes) if ref else None,
                           jit_mem=_ratio(m.memory_per_device, ref.memory_per_device) if ref else None, secs=secs)
                rows.append(row)
                _print(row)
    summary(rows)
    if a.csv:
        with open(a.csv, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def summary(rows):
    """Per policy: the worst ratio to jax.jit over the experts' specs (target <= 1.05) and how
    many rows the estimate holds for (bytes sent within 10%, memory within 25%)."""
    print("\npolicy    worst /jit sent  worst /jit mem   bytes within 10%   memory within 25%")
    for policy in dict.fromkeys(r["pins"] for r in rows if r["pins"] != "jit"):
        got = [r for r in rows if r["pins"] == policy]
        specs = [r for r in got if r["jit_sent"] is not None]
        sent = sum(abs(_ratio(r["sent"], r["est_sent"]) - 1) <= 0.10 for r in got)
        mem = sum(abs(_ratio(r["mem"], r["est_mem"]) - 1) <= 0.25 for r in got)
        worst_sent = max((r["jit_sent"] for r in specs), default=float("nan"))
        worst_mem = max((r["jit_mem"] for r in specs), default=float("nan"))
        print(f"{policy:<10}{worst_sent:>15.2f}{worst_mem:>16.2f}{sent:>12}/{len(got)}{mem:>16}/{len(got)}")


def _ratio(a, b):
    return a / b if b else (1.0 if a == b else float("inf"))


def _print(r):
    kib = lambda x: f"{x / 1024:.1f}K"  # noqa: E731
    jit = (f"{r['jit_sent']:>10.2f}{r['jit_mem']:>9.2f}" if r["jit_sent"] is not None else f"{'':>10}{'':>9}")
    print(f"{r['model']:<16}{r['plan']:<15}{r['pins']:<8}{r['n']:>6}{kib(r['est_sent']):>10}{kib(r['sent']):>10}"
          f"{_ratio(r['sent'], r['est_sent']):>7.2f}{kib(r['est_mem']):>10}{kib(r['mem']):>10}"
          f"{_ratio(r['mem'], r['est_mem']):>7.2f}{jit}{r['secs']:>10.1f}", flush=True)


if __name__ == "__main__":
    main()
