"""Recomputing blocks (automap/ir/recompute.py) of a model holding its own ``jax.checkpoint``:
the user's remat call, replayed as one ``jax.checkpoint`` whose body reads only the call's
inputs, reads the clones (or re-gathered parameters) its ops now read, and the step gives the
unsharded step's numbers (held-out ``nnx_scan``, ``nnx.remat`` inside ``nnx.scan``, compiled to
"value #304 used before it is defined" before)."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import _compat, emit
from automap.ir.recompute import pending_blocks, recompute_state, repeated_blocks, selective
from automap.ir.unremat import drop_remat_state


def _sgd(loss):
    """A plain SGD step (``optax.sgd``) of ``loss(params, data)``: (the updated ``params``, the loss)."""
    opt = optax.sgd(0.1)

    def step(params, data):
        value, grad = jax.value_and_grad(loss)(params, data)
        return optax.apply_updates(params, opt.update(grad, opt.init(params))[0]), value
    return step


def _inner(x, w):
    return jnp.tanh(jnp.sin(x @ w) @ w.T)


LAYERS = {  # a scanned layer, wholly under jax.checkpoint or holding it in part
    "whole": jax.checkpoint(lambda x, w: (_inner(x, w), None)),
    "part": lambda x, w: (jnp.cos(jax.checkpoint(_inner)(jnp.tanh(2.0 * x), w)) * x, None),
}


def _run(state, mesh, args):
    jitted = emit.compile_plan(state, _compat.auto_view(mesh), pins=emit.pinned_values(state, "plan"))
    return jitted(*jax.tree.leaves(args))


def _assert_unsharded(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_recomputing_a_scan_whose_layer_holds_jax_checkpoint_gives_the_unsharded_step(layer):
    """``lax.scan`` over a layer holding ``jax.checkpoint``, data parallel on 8 devices: the scan
    recomputed (wholly, kept or dropped first; selectively) compiles and gives the unsharded SGD
    step's weights and loss."""
    step = _sgd(lambda ws, x: (jax.lax.scan(LAYERS[layer], x, ws)[0] ** 2).mean())
    rng = np.random.default_rng(0)
    args = (jnp.asarray(rng.standard_normal((3, 16, 32)) * 0.3, jnp.float32),
            jnp.asarray(rng.standard_normal((64, 16)), jnp.float32))
    mesh = automap.make_mesh({"data": 8})
    kept = automap.partition(step, mesh=mesh, tactics=[tactics.data_parallel("data")], search=None, arbiter=None,
                             keep_user_remat=True).plan(*args).state
    assert kept.program.remat_calls
    want = jax.jit(step)(*args)
    (block,) = pending_blocks(kept.program)
    tries = [recompute_state(kept, [block])]
    if layer == "part":  # the whole layer under jax.checkpoint leaves only its input stacked: one way to redo it
        tries += [recompute_state(kept, [selective(block)]), recompute_state(drop_remat_state(kept), [block])]
    for state in tries:
        assert state.program.recomputed
        _assert_unsharded(_run(state, mesh, args), want)


def test_recomputing_blocks_after_a_checkpointed_embedding_sharing_their_weight_gives_the_unsharded_step():
    """Unrolled: a ``jax.checkpoint``-ed embedding stem reads the weight the two blocks after it
    read. Under FSDP, a block recomputed wholly re-gathers that weight for the backward, and the
    stem's checkpoint call, whose backward comes last, reads the re-gathered copy; the zeros its
    backward scatters the table's gradient into are made inside the call and stay there (not
    tied to the backward between its ops)."""
    def loss(params, ids):
        w, table = params
        h = jax.checkpoint(lambda table, ids, w: jnp.sin(table[ids] @ w))(table, ids, w)
        for i in range(2):
            with jax.named_scope(f"block_{i}"):
                h = jnp.tanh(jnp.cos(h @ w) @ w)
        return (h ** 2).mean()

    step = _sgd(loss)
    rng = np.random.default_rng(0)
    args = ((jnp.asarray(rng.standard_normal((16, 16)) * 0.3, jnp.float32),
             jnp.asarray(rng.standard_normal((64, 16)), jnp.float32)), jnp.asarray(rng.integers(0, 64, 64), jnp.int32))
    mesh = automap.make_mesh({"data": 8})
    kept = automap.partition(step, mesh=mesh, tactics=[tactics.fsdp("data")], search=None, arbiter=None,
                             keep_user_remat=True).plan(*args).state
    want = jax.jit(step)(*args)
    for names in (["block_1"], ["block_0", "block_1"]):
        state = recompute_state(kept, names)
        assert state.program.recomputed == tuple(names)
        _assert_unsharded(_run(state, mesh, args), want)


def _checkpointed_recurrence(c, r):
    return 0.5 * c + r, jnp.sin(c + r) * jnp.cos(c)


def _layers_scanning_a_checkpoint(ws, x):  # numbered layers, each a lax.scan over time whose body is checkpointed
    for i, w in enumerate(ws):
        with jax.named_scope(f"layer_{i}"):
            h = jnp.tanh(x @ w)  # (time, batch, 32)
            with jax.named_scope("recurrence"):  # (unscoped, the scan is named by its layer: a scanned block)
                _, h = jax.lax.scan(jax.checkpoint(_checkpointed_recurrence), h[0] * 0, h)
            x = jnp.tanh(h @ w.T)
    return (x ** 2).sum()


@pytest.mark.parametrize("way", ["whole", "selective"])
def test_a_layer_holding_a_scan_of_jax_checkpoint_is_recomputed_around_it(way):
    """A numbered layer holding a ``lax.scan`` whose body is the user's ``jax.checkpoint``, data
    parallel over the batch on 8 devices: every layer recomputed (wholly, or selectively) leaves
    the scans as traced (none cloned, the user's remat calls kept in their bodies), gives the
    unsharded gradients, and XLA's temporaries drop."""
    rng = np.random.default_rng(0)
    ws = [jnp.asarray(rng.standard_normal((16, 32)) * 0.1, jnp.float32) for _ in range(3)]
    x = jnp.asarray(rng.standard_normal((4, 64, 16)), jnp.float32)
    grad = jax.grad(_layers_scanning_a_checkpoint)
    mesh = automap.make_mesh({"data": 8})
    plan = automap.partition(grad, mesh=mesh, tactics=[tactics.manual({"^x": P(None, "data", None)})], search=None,
                             arbiter=None).plan(ws, x)
    assert len(plan.program.remat_calls) == 3
    blocks = [f"layer_{i}" for i in range(3)]
    assert repeated_blocks(plan.program) == tuple(f"{b}/recurrence" for b in blocks) + tuple(blocks)
    state = recompute_state(plan.state, blocks if way == "whole" else [selective(b) for b in blocks])
    assert [b.split(" ")[0] for b in state.program.recomputed] == blocks
    scans = [(op.id, op.phase) for op in state.program.ops if op.primitive == "scan"]
    assert scans == [(op.id, op.phase) for op in plan.program.ops if op.primitive == "scan"]  # no scan cloned
    assert len(state.program.remat_calls) == 3
    flat = [*ws, x]
    _assert_unsharded(_run(state, mesh, flat), jax.jit(grad)(ws, x))
    kept, redone = (automap.measure(emit.compile_plan(s, _compat.auto_view(mesh), pins=emit.pinned_values(s, "plan"))
                                    .lower(*flat).compile()).memory.temp for s in (plan.state, state))
    assert redone < 0.95 * kept  # 61,040 -> 47,856 B wholly, 55,920 B selectively (a scratch run)
