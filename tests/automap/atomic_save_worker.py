"""Saves a checkpoint and a plan file over and over until killed (tests/automap/test_atomic_saves.py).

    python atomic_save_worker.py DIR

Writes DIR/a.json and DIR/b.json (two different plans, the references), then for k = 0, 1, 2, ...
saves plan (a if k is even, else b) to DIR/plan.json and the checkpoint {"w": [k, k, k, k]} to
DIR/ckpt (force=True), printing "saved k" after both; "ready" after k = 0.
"""
import os
import sys


def main(folder: str) -> None:
    # imported here, not at module level: pytest's --doctest-modules imports this file inside
    # the test process, where an XLA_FLAGS set at import would shrink every test's device count
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import automap
    import tactics
    from automap import checkpoint

    mesh = automap.make_mesh({"data": 2})
    plans = [automap.partition(jnp.tanh, mesh=mesh, tactics=[tactics.manual({"x": spec})], search=None).plan(
        jnp.ones((8, 4))) for spec in (P("data"), P(None, "data"))]
    for name, plan in zip("ab", plans):
        plan.save(os.path.join(folder, f"{name}.json"))
    k = 0
    while True:
        plans[k % 2].save(os.path.join(folder, "plan.json"))
        checkpoint.save(os.path.join(folder, "ckpt"), {"w": np.full((4,), k, np.float32)}, force=True)
        print(f"saved {k}", flush=True)
        if k == 0:
            print("ready", flush=True)
        k += 1


if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"  # before JAX starts
    main(sys.argv[1])
