"""``python -m automap demo``: a zoo GPT train step on 8 simulated CPU devices, mesh 2x4.

Plans it three times (the default: an MCTS search over both mesh axes under the device memory;
the batch over every mesh axis, with no search; and Megatron tensor parallelism given as
manual regex rules on the parameters plus the batch on ``data``), compiles and runs each, and
prints first what XLA compiled for each (collectives, memory per device) with the loss against
the unsharded step, then each plan's report.
"""
from __future__ import annotations

import os
import time
from typing import Any, Sequence


def megatron_rules(scanned: bool) -> list[tuple[str, Any]]:
    """Expert Megatron specs for the zoo GPT parameters, as ``tactics.manual`` rules."""
    from jax.sharding import PartitionSpec as P

    lead = (None,) if scanned else ()
    return [
        (r"^state/params/.*attn/qkv/kernel$", P(*lead, None, None, "model", None)),
        (r"^state/params/.*attn/qkv/bias$", P(*lead, None, "model", None)),
        (r"^state/params/.*attn/out/kernel$", P(*lead, "model", None, None)),
        (r"^state/params/.*mlp/up/kernel$", P(*lead, None, "model")),
        (r"^state/params/.*mlp/up/bias$", P(*lead, "model")),
        (r"^state/params/.*mlp/down/kernel$", P(*lead, "model", None)),
        (r"^state/params/wte/embedding$", P("model", None)),
        (r"^state/params/head/kernel$", P(None, "model")),
        (r"^state/params/head/bias$", P("model")),
        (r"^batch/", P("data")),
    ]


def _row(name: str, m: Any, loss: float, ref: float, plan_s: float) -> str:
    kinds = ", ".join(f"{k} {v.count}x {v.bytes / 1024:.1f}KiB" for k, v in m.collectives.items()) or "none"
    rel = abs(loss - ref) / max(abs(ref), 1e-12)
    return (
        f"{name:<22} plan {plan_s * 1000:6.0f} ms | collectives {m.collective_bytes / 1024:8.1f} KiB ({kinds}) | "
        f"memory/device {m.memory_per_device / 1024:8.1f} KiB | loss {loss:.6f} (rel. diff {rel:.1e})"
    )


def main(argv: Sequence[str] = ()) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m automap demo", description=__doc__)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--scan", action="store_true", help="scan over layers")
    parser.add_argument("--nnx", action="store_true", help="the flax nnx model instead of linen")
    args = parser.parse_args(list(argv))

    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax

    import automap
    import tactics
    from automap import zoo

    if jax.device_count() < 8:
        print(f"the demo needs 8 devices, found {jax.device_count()}: run it in a fresh process")
        return 1
    cfg = zoo.GPTConfig(layers=args.layers, scan=args.scan)
    workload = (zoo.gpt_nnx if args.nnx else zoo.gpt_linen)(cfg)
    state, batch = workload.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    print(f"automap demo: {workload.name} ({cfg}) on mesh data=2 x model=4, {jax.device_count()} CPU devices\n")

    _, ref_loss = jax.jit(workload.train_step)(state, batch)
    ref = float(ref_loss)
    rows, reports, ok = [], [], True
    plans = [
        ("default (search)", {}),
        ("batch (no search)", {"search": None}),
        ("megatron (manual)", {"tactics": [tactics.manual(megatron_rules(cfg.scan))]}),
    ]
    for name, options in plans:
        step = automap.automap(workload.train_step, mesh=mesh, **options)
        t0 = time.perf_counter()
        plan = step.plan(state, batch)
        plan_s = time.perf_counter() - t0
        reports.append(f"== {name}\n{plan.report()}\n")
        m = automap.measure(step.lower(state, batch).compile())
        _, loss = step(state, batch)
        rows.append(_row(name, m, float(loss), ref, plan_s))
        ok &= abs(float(loss) - ref) <= 1e-5 * abs(ref)
    # the comparison first, then each plan's report (what it chose and why)
    print("== measured by XLA (per device, one step)")
    print("\n".join(rows))
    print(f"unsharded loss {ref:.6f}: {'all plans match' if ok else 'MISMATCH'}\n")
    print("\n".join(reports))
    return 0 if ok else 1
