"""Tactic presets on the 12-layer zoo GPT (d_model 64, vocab 256, batch 8 x 16), mesh 2x4:
XLA-measured collectives and memory per device, the cost model's collective bytes, plan time
and the loss against the unsharded step.

    python benchmarks/presets.py
"""
import os
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
import _isolate  # noqa: E402,F401  (first: keeps benchmarks/search.py from shadowing the package)
import jax  # noqa: E402

import automap  # noqa: E402
import tactics  # noqa: E402
from automap import zoo  # noqa: E402


def main() -> None:
    w = zoo.gpt_linen(zoo.GPTConfig(layers=12))
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    ref = float(jax.jit(w.train_step)(state, batch)[1])
    print("| preset | XLA collectives | by kind | XLA memory/device | estimated collectives | plan time | loss rel. diff |")
    print("|---|---|---|---|---|---|---|")
    presets = [
        ("data_parallel", [tactics.data_parallel("data")]), ("megatron_dp", [tactics.megatron_dp()]),
        ("fsdp_only", [tactics.fsdp_only()]), ("fsdp_tp", [tactics.fsdp_tp()]),
        ("zero_dp(1)", [tactics.zero_dp(1)]), ("zero_dp(2)", [tactics.zero_dp(2)]),
        ("default (MCTS search)", None),
    ]
    for name, schedule in presets:
        step = automap.automap(w.train_step, mesh=mesh, tactics=schedule)
        t = time.time()
        plan = step.plan(state, batch)
        plan_s = time.time() - t
        m = automap.measure(step.lower(state, batch).compile())
        loss = float(step(state, batch)[1])
        kinds = ", ".join(f"{k} {v.count}x {v.bytes / 1024:.0f}KiB" for k, v in m.collectives.items())
        print(f"| {name} | {m.collective_bytes / 1024:.1f} KiB | {kinds} | {m.memory_per_device / 1024:.0f} KiB | "
              f"{plan.estimate.collective_bytes / 1024:.1f} KiB | {plan_s:.2f} s | {abs(loss - ref) / abs(ref):.1e} |",
              flush=True)


if __name__ == "__main__":
    main()
