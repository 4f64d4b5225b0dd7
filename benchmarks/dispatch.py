"""Per-step cost of calling an automap'd train step in a training loop, beside ``jax.jit`` given
the plan's own in/out shardings (the same compiled program): each loop feeds the step's new state
back and a fresh numpy batch in, as a data loader does; timed per step over ``--steps`` steps,
rounds alternated between the two, the median round reported. The ratio is automap's overhead
on top of the program (target: 1.0 within noise).

    python benchmarks/dispatch.py [--layers 2] [--d-model 64] [--seq 32] [--batch 8] [--steps 10]
                                  [--rounds 8] [--devices 1]

``--devices 1`` (default) is one device of the local backend (a GPU where there is one); on CPU
``--devices 8`` simulates 8 and plans over data=2 x model=4.
"""
import argparse
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--devices", type=int, default=1)
    a = ap.parse_args()
    if a.devices > 1:
        os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={a.devices}")
    import _isolate  # noqa: F401  (first: keeps benchmarks/search.py from shadowing the package)

    import jax
    import numpy as np

    import automap
    from automap import zoo

    cfg = zoo.GPTConfig(layers=a.layers, d_model=a.d_model, heads=a.heads, seq=a.seq, vocab=a.vocab, batch=a.batch)
    w = zoo.gpt_linen(cfg)
    axes = {"data": 2, "model": a.devices // 2} if a.devices > 1 else {"data": 1}
    mesh = automap.make_mesh(axes)
    step = automap.automap(w.train_step, mesh=mesh)
    plan = step.plan(*w.abstract())
    jitted = jax.jit(w.train_step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)
    state0, batch0 = w.init(0)
    host_batch = jax.tree.map(np.asarray, batch0)  # what a data loader hands over

    def per_step_ms(f) -> float:
        state, loss = f(state0, host_batch)
        jax.block_until_ready(loss)
        start = time.perf_counter()
        for _ in range(a.steps):
            state, loss = f(state, host_batch)
        jax.block_until_ready((state, loss))
        return (time.perf_counter() - start) / a.steps * 1e3

    per_step_ms(step), per_step_ms(jitted)  # compiled and warm
    rounds: dict[str, list[float]] = {"automap": [], "jax.jit": []}
    for _ in range(a.rounds):
        rounds["automap"].append(per_step_ms(step))
        rounds["jax.jit"].append(per_step_ms(jitted))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"{w.name} {cfg.layers} layers, d_model {cfg.d_model}, batch {cfg.batch} x seq {cfg.seq}; mesh {axes} on "
          f"{jax.default_backend()} ({jax.devices()[0].device_kind}); {len(jax.tree.leaves(state0))} state leaves")
    for k, v in rounds.items():
        print(f"  {k:<8} {med[k]:8.3f} ms/step (median of {a.rounds} rounds of {a.steps} steps; "
              f"min {min(v):.3f}, max {max(v):.3f})")
    print(f"  ratio automap / jax.jit = {med['automap'] / med['jax.jit']:.3f}")


if __name__ == "__main__":
    main()
