"""Recomputation in a model without repeated blocks (automap/ir/segments.py): the segments of its
forward are checkpointed like blocks when no plan fits the memory budget otherwise, and XLA's
measure of the compiled plan is within the budget, with the unsharded step's numbers."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

import automap
from automap.ir.recompute import recompute_units, repeated_blocks

WIDTHS = (16, 64, 48, 32, 8)  # every layer of its own shape: no repeated block


def _loss(p, x):
    h = x
    for i in range(len(WIDTHS) - 1):
        h = jnp.tanh(h @ p[f"w{i}"])
        h = jnp.tanh(h) * jnp.sin(h)  # residuals that outweigh the weights
    return (h**2).mean()


def _step(p, x):
    loss, grads = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss


def _args():
    rng = np.random.default_rng(0)
    p = {f"w{i}": (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
         for i, (a, b) in enumerate(zip(WIDTHS, WIDTHS[1:]))}
    return p, rng.standard_normal((256, 16)).astype(np.float32)


BUDGET = 85_000  # bytes per device; without recomputing segments: MemoryBudgetError, no plan explored under 95.5 KiB


def test_segments_of_a_model_without_repeated_blocks_are_recomputed_to_fit_by_xla_measure():
    p, x = _args()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    step = automap.partition(_step, mesh=mesh, memory_budget=BUDGET)
    plan = step.plan(p, x)
    assert repeated_blocks(plan.program) == ()
    assert recompute_units(plan.program) == ("forward from x", "forward from p/w1", "forward from p/w2",
                                             "forward from p/w3")
    done = plan.state.program.recomputed
    assert done and all(d.startswith("forward from ") for d in done)
    assert "recomputed in the backward (activation checkpointing): " + ", ".join(done) in plan.report()
    assert automap.measure(step.lower(p, x).compile()).memory_per_device <= BUDGET
    (new, loss), (ref_new, ref_loss) = step(p, x), jax.jit(_step)(p, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
