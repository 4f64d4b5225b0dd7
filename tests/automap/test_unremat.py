"""Dropping a user's remat (automap/ir/unremat.py): the program after the drop has the ops of the
model traced without remat, the replayed step gives the unsharded step's numbers, and XLA
compiles fewer FLOPs for more memory."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import collections
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import automap
import tactics
from automap import _compat, emit, zoo
from automap.cost import estimate
from automap.ir.lower import lower
from automap.ir.unremat import drop_remat, drop_remat_state
from automap.trace import trace

CFG = zoo.GPTConfig(layers=2, batch=16, seq=32, vocab=64)


@functools.lru_cache(maxsize=None)
def _gpt(scan: bool, remat: bool):
    """The tiny GPT and its lowered step; scanned with dropout (the forward's random bits, read
    again instead of redrawn)."""
    w = zoo.gpt_linen(dataclasses.replace(CFG, scan=scan, remat=remat, dropout=0.1 if scan else 0.0))
    state, batch = w.init(0)
    t = trace(w.train_step, (state, batch))
    return w, state, batch, lower(t.closed_jaxpr, t.in_paths, t.out_paths)


def _counts(program):
    return collections.Counter(op.primitive for op in program.all_ops)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_dropping_nn_remat_gives_the_ops_of_the_model_without_it(scan):
    """``nn.remat(Block)`` (unrolled) and ``nn.scan(nn.remat(Block))`` (with dropout): every
    recomputed forward op is matched to the forward's; what is left has the primitives of the
    model traced without remat, one for one, but ``broadcast_in_dim`` of literals, which the
    match merges where JAX repeats them (17 fewer unrolled, 16 scanned)."""
    with_remat, plain = _gpt(scan, True)[3], _gpt(scan, False)[3]
    dropped = drop_remat(with_remat)
    assert with_remat.remat_calls and not dropped.remat_calls and dropped.dropped_remat == len(with_remat.remat_calls)
    assert not any(op.remat for op in dropped.all_ops)
    got, want = _counts(dropped), _counts(plain)
    assert _counts(with_remat)["dot_general"] > want["dot_general"]  # the recomputed matmuls, before
    assert got["broadcast_in_dim"] <= want["broadcast_in_dim"]
    del got["broadcast_in_dim"], want["broadcast_in_dim"]
    assert got == want
    assert drop_remat(plain) is plain


def _compiled(state, mesh, flat):
    jitted = emit.compile_plan(state, _compat.auto_view(mesh), pins=emit.pinned_values(state, "plan"))
    return automap.measure(jitted.lower(*flat).compile()), jitted(*flat)


def _stack(ws, x, remat):
    layer = lambda x, w: (jnp.tanh(jnp.tanh(x @ w) @ w.T), None)  # noqa: E731
    return (jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, ws)[0] ** 2).sum()


def _stack_args():
    rng = np.random.default_rng(0)
    return (jnp.asarray(rng.standard_normal((3, 64, 128)) * 0.1, jnp.float32),
            jnp.asarray(rng.standard_normal((512, 64)), jnp.float32))  # activations outweigh the weights


def test_dropping_jax_checkpoint_in_a_scan():
    """``jax.lax.scan(jax.checkpoint(layer))`` in a pure-JAX model, data parallel on 8 devices:
    dropped (as ``tactics.recompute("none", user_remat="drop")`` does), the backward scan reads the forward's stacked values instead of recomputing them:
    the gradients, the ops and XLA's FLOPs of the model without ``jax.checkpoint``, fewer than
    with it (as estimated), for more memory."""
    ws, x = _stack_args()
    mesh = automap.make_mesh({"data": 8})
    fns = {remat: jax.value_and_grad(functools.partial(_stack, remat=remat)) for remat in (True, False)}
    plans = {remat: automap.partition(fn, mesh=mesh, tactics=[tactics.data_parallel("data")], search=None,
                                      arbiter=None).plan(ws, x) for remat, fn in fns.items()}
    kept, plain = plans[True].state, plans[False].state
    dropped = drop_remat_state(kept)
    assert _counts(dropped.program) == _counts(plain.program) != _counts(kept.program)
    by_tactic = automap.partition(fns[True], mesh=mesh, search=None, tactics=[
        tactics.data_parallel("data"), tactics.recompute("none", user_remat="drop")]).plan(ws, x)
    assert by_tactic.state.program.dropped_remat == 1 and by_tactic.state.specs == dropped.specs
    (measured_kept, _), (got, (loss, grads)), (measured_plain, _) = (
        _compiled(s, mesh, [ws, x]) for s in (kept, dropped, plain))
    want_loss, want_grads = jax.jit(fns[False])(ws, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-5, atol=1e-4)
    assert got.dot_flops == measured_plain.dot_flops < measured_kept.dot_flops
    est_kept, est_got = estimate(kept), estimate(dropped)
    assert measured_kept.dot_flops - got.dot_flops == pytest.approx(est_kept.dot_flops - est_got.dot_flops, rel=1e-6)
    assert got.memory.temp > measured_kept.memory.temp and est_got.memory.temp > est_kept.memory.temp


def test_the_search_drops_a_remat_with_memory_to_spare_and_keeps_it_under_a_tight_budget(tmp_path):
    """With the device's memory to spare, the plan without the model's ``jax.checkpoint`` is
    faster and the search takes it (the report says so; the step gives the same numbers); under
    a budget the remat's own peak (or 1.2x it), the same plan without it does not fit and
    recomputing the block in its place is no better: the remat stays. ``keep_user_remat=True``
    keeps it whatever the budget. A dropped remat is dropped again when the plan is loaded."""
    ws, x = _stack_args()
    mesh = automap.make_mesh({"data": 8})
    fn = jax.value_and_grad(functools.partial(_stack, remat=True))
    step = automap.partition(fn, mesh=mesh, arbiter=None)
    free = step.plan(ws, x)
    kept = automap.partition(fn, mesh=mesh, arbiter=None, keep_user_remat=True).plan(ws, x)
    assert free.state.program.dropped_remat == 1 and kept.state.program.remat_calls
    assert free.estimate.time_s < kept.estimate.time_s and free.estimate.peak_memory_bytes > kept.estimate.peak_memory_bytes
    assert "the model's own remat dropped (1 jax.checkpoint call(s))" in free.report()
    assert any("drop the model's remat (1 call(s))" in n for n in free.notes)
    loss, grads = step(ws, x)
    want_loss, want_grads = jax.jit(fn)(ws, x)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    np.testing.assert_allclose(grads, want_grads, rtol=1e-5, atol=1e-4)
    for factor in (1.0, 1.2):
        budget = int(factor * kept.estimate.peak_memory_bytes)
        tight = automap.partition(fn, mesh=mesh, arbiter=None, memory_budget=budget).plan(ws, x)
        assert tight.state.program.remat_calls and not tight.state.program.dropped_remat
        assert tight.estimate.peak_memory_bytes <= budget
        assert any(n.startswith("search: kept the model's remat") for n in tight.notes)
    free.save(tmp_path / "plan.json")
    loaded = automap.partition(fn, mesh=mesh, plan=str(tmp_path / "plan.json")).plan(ws, x)
    assert loaded.state.program.dropped_remat == 1 and loaded.state.specs == free.state.specs
