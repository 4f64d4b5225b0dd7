"""Recomputation in a model whose one layer is applied again and again, its parameters shared
(ALBERT's encoder; automap/ir/shared_layers.py): each application is a block, found by its
parameters' reads, recomputed when no plan fits the memory budget otherwise; XLA's measure of the
compiled plan is within the budget, with the unsharded step's numbers."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np

import automap
from automap.ir.lower import lower
from automap.ir.recompute import recompute_units
from automap.ir.shared_layers import shared_layers

CALLS = 4


def _loss(p, x):
    h = jnp.tanh(x @ p["w_in"])
    for _ in range(CALLS):  # one layer, one scope, its weight shared: no numbered block, no alike parameters
        with jax.named_scope("layer"):
            h = h + jnp.tanh(h @ p["w"]) * jnp.sin(h)  # residuals that outweigh the weights
    return (h @ p["w_out"]).var()


def _step(p, x):
    loss, grads = jax.value_and_grad(_loss)(p, x)
    return jax.tree.map(lambda w, g: w - 0.1 * g, p, grads), loss


def _args():
    rng = np.random.default_rng(0)
    p = {"w_in": rng.standard_normal((16, 32)) / 4, "w": rng.standard_normal((32, 32)) / 6,
         "w_out": rng.standard_normal((32, 8)) / 6}
    return jax.tree.map(np.float32, p), rng.standard_normal((512, 16)).astype(np.float32)


LAYERS = tuple(f"layer (call {i} of {CALLS})" for i in range(1, CALLS + 1))
# 0.8x the smallest expert plan (FSDP over both axes, 138,260 B by XLA's measure); before the
# applications were blocks: MemoryBudgetError (the forward's segments, the last holding every
# application, left 139.5 KiB by estimate); now the first two applications recomputed: 105,748 B
BUDGET = 110_608


def test_the_applications_of_a_shared_layer_are_its_blocks():
    p, x = _args()
    prog = lower(jax.make_jaxpr(_step)(p, x), ["p/w", "p/w_in", "p/w_out", "x"],
                 ["new/w", "new/w_in", "new/w_out", "loss"])
    assert recompute_units(prog) == LAYERS
    calls = shared_layers(prog)
    ops = list(calls.values())
    assert len({len(o) for o in ops}) == 1  # each application as many ops, one after another
    assert all(max(a) < min(b) for a, b in zip(ops, ops[1:]))
    by_id = {op.id: op for op in prog.ops}
    dots = [[by_id[i] for i in o if by_id[i].primitive == "dot_general"] for o in ops]
    assert all(len(d) == 1 and prog.values[d[0].inputs[1]].name == "p/w" for d in dots)


def test_a_tied_weight_read_at_two_places_is_no_shared_layer():
    def loss(e, x):  # an embedding read by the lookup and again by the output projection
        return jnp.tanh(jnp.sin(e[x]) @ e.T).sum()

    e = jnp.ones((16, 8))
    prog = lower(jax.make_jaxpr(jax.grad(loss))(e, jnp.arange(4)), ["e", "x"], ["g"])
    assert shared_layers(prog) == {}


def test_a_shared_layer_model_recomputes_its_applications_to_fit_by_xla_measure():
    p, x = _args()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    step = automap.partition(_step, mesh=mesh, memory_budget=BUDGET)
    plan = step.plan(p, x)
    done = plan.state.program.recomputed
    assert done and all(d.split(" (call")[0] == "layer" for d in done)
    assert automap.measure(step.lower(p, x).compile()).memory_per_device <= BUDGET
    (new, loss), (ref_new, ref_loss) = step(p, x), jax.jit(_step)(p, x)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
