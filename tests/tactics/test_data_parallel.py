"""``tactics.data_parallel``: the batch dim of each data input is found from the data flow (never
from its position or size); inputs without one, and batches the axis does not divide, are left
whole with a note."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo


def _sds(*shape, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype)


def _sgd(loss):
    def step(params, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value
    return step


def _batch_first(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def _features_first(params, batch):  # columns are examples: (features, batch)
    return jnp.mean((params["w2"] @ jnp.tanh(params["w1"] @ batch["x"]) - batch["y"]) ** 2)


def _lookup_table(params, batch):  # a table passed with the batch, contracted with the examples
    return jnp.mean(jnp.tanh(batch["x"] @ batch["table"] @ params["w1"]) ** 2)


def _weighted(params, batch):  # per-example weights (batch,) and a scalar temperature
    err = jnp.sum((batch["x"] @ params["w1"]) ** 2, axis=1)
    return jnp.sum(batch["weight"] * err) / batch["temperature"]


def _sequence(params, batch):  # (batch, seq, features) with a position embedding on seq
    h = batch["x"] + params["pos"]
    return jnp.mean(jnp.tanh(h @ params["w1"]))


def _recurrent(params, batch):  # (batch, seq, features) scanned over seq from a zero state
    def cell(h, x):  # the carry starts as a constant, then holds the data: not a weight
        h = jnp.tanh(h @ params["wh"] + x @ params["wx"])
        return h, h
    h0 = jnp.zeros((batch["x"].shape[0], params["wh"].shape[0]))
    h, _ = jax.lax.scan(cell, h0, jnp.swapaxes(batch["x"], 0, 1))
    return jnp.mean(h ** 2)


def _broadcast_bias(params, batch):  # stacked layers scanned, each bias broadcast to the output's shape first (haiku)
    def layer(h, p):
        out = h @ p["w"]
        return jnp.tanh(out + jnp.broadcast_to(p["b"], out.shape)), None
    h, _ = jax.lax.scan(layer, batch["x"], params["layers"])
    return jnp.mean(h ** 2)


BATCH_FIRST = {"w1": _sds(16, 32), "w2": _sds(32, 4)}
FEATURES_FIRST = {"w1": _sds(32, 16), "w2": _sds(4, 32)}

ROWS = [
    # (loss, params, batch, mesh, want spec per batch leaf, note fragments)
    ("batch-first", _batch_first, BATCH_FIRST, {"x": _sds(8, 16), "y": _sds(8, 4)}, {"data": 8},
     {"x": P("data"), "y": P("data")}, ["batch dims batch/x[0], batch/y[0]"]),
    ("features-first", _features_first, FEATURES_FIRST, {"x": _sds(16, 8), "y": _sds(4, 8)}, {"data": 8},
     {"x": P(None, "data"), "y": P(None, "data")}, ["batch dims batch/x[1], batch/y[1]"]),
    # square: the sizes cannot tell the dims apart, the flow can
    ("features-first-square", _features_first, {"w1": _sds(32, 16), "w2": _sds(16, 32)},
     {"x": _sds(16, 16), "y": _sds(16, 16)}, {"data": 8},
     {"x": P(None, "data"), "y": P(None, "data")}, ["batch/x[1]"]),
    ("lookup-table", _lookup_table, {"w1": _sds(16, 32)}, {"x": _sds(8, 16), "table": _sds(16, 16)}, {"data": 2},
     {"x": P("data"), "table": P()}, ["batch/table has no batch dim", "left whole", "batch dims batch/x[0]"]),
    ("weights-and-scalar", _weighted, {"w1": _sds(16, 4)},
     {"x": _sds(8, 16), "weight": _sds(8), "temperature": _sds()}, {"data": 4},
     {"x": P("data"), "weight": P("data"), "temperature": P()}, ["batch/weight[0]"]),
    ("sequence", _sequence, {"pos": _sds(8, 16), "w1": _sds(16, 4)}, {"x": _sds(8, 8, 16)}, {"data": 8},
     {"x": P("data")}, ["batch dims batch/x[0]"]),
    ("recurrent-zero-state", _recurrent, {"wh": _sds(8, 8), "wx": _sds(16, 8)}, {"x": _sds(8, 4, 16)}, {"data": 8},
     {"x": P("data")}, ["batch dims batch/x[0]"]),
    # the batch dim meets the broadcast bias on a dim the broadcast made, not one of the weight's
    ("broadcast-bias-scanned", _broadcast_bias, {"layers": {"w": _sds(2, 16, 16), "b": _sds(2, 16)}},
     {"x": _sds(8, 16)}, {"data": 8}, {"x": P("data")}, ["batch dims batch/x[0]"]),
    ("not-divisible", _batch_first, BATCH_FIRST, {"x": _sds(6, 16), "y": _sds(6, 4)}, {"data": 4},
     {"x": P(), "y": P()}, ["skips batch/x", "not divisible by 4", "no batch dim divisible by the axis; nothing done"]),
    ("only-a-table", _lookup_table, {"w1": _sds(16, 32)}, {"x": _sds(1, 16), "table": _sds(16, 16)}, {"data": 2},
     {"x": P(), "table": P()}, ["no data input has a batch dim", "nothing done"]),
]


@pytest.mark.parametrize("loss, params, batch, axes, want, notes", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_batch_dim_is_found_structurally(loss, params, batch, axes, want, notes):
    mesh = automap.make_mesh(axes)
    plan = automap.partition(_sgd(loss), mesh=mesh, tactics=[tactics.data_parallel("data")]).plan(params, batch)
    specs = {p: plan.state.partition_spec(v) for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)}
    assert {k: specs[f"batch/{k}"] for k in want} == want
    # the parameters follow by propagation: replicated (their gradients are all-reduced)
    assert all(spec == P() for p, spec in specs.items() if p.startswith("params/"))
    text = "\n".join(plan.notes)
    assert all(fragment in text for fragment in notes), plan.notes
    if all(spec == P() for spec in want.values()):  # nothing applied: the state is untouched
        assert not any(any(dim) for spec in plan.state.specs.values() for dim in spec)


def test_features_first_numerics():
    rng = np.random.default_rng(0)
    params = {"w1": rng.normal(size=(32, 16)).astype(np.float32), "w2": rng.normal(size=(4, 32)).astype(np.float32)}
    batch = {"x": rng.normal(size=(16, 8)).astype(np.float32), "y": rng.normal(size=(4, 8)).astype(np.float32)}
    step = automap.partition(_sgd(_features_first), mesh=automap.make_mesh({"data": 8}),
                             tactics=[tactics.data_parallel("data")])
    assert step.plan(params, batch).in_shardings[1]["x"].spec == P(None, "data")
    new, loss = step(params, batch)
    ref_new, ref_loss = jax.jit(_sgd(_features_first))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_recurrent_zero_state_numerics():
    """The scanned RNN of the row above, its batch split: the unsharded step's numbers, and each
    device runs its share of the recurrence (XLA's dot FLOPs at most 1/8 of the unsharded program's)."""
    rng = np.random.default_rng(0)
    params = {"wh": rng.normal(size=(8, 8)).astype(np.float32), "wx": rng.normal(size=(16, 8)).astype(np.float32)}
    batch = {"x": rng.normal(size=(8, 4, 16)).astype(np.float32)}
    step = automap.partition(_sgd(_recurrent), mesh=automap.make_mesh({"data": 8}),
                             tactics=[tactics.data_parallel("data")])
    assert step.plan(params, batch).in_shardings[1]["x"].spec == P("data")
    new, loss = step(params, batch)
    ref_new, ref_loss = jax.jit(_sgd(_recurrent))(params, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ours = automap.measure(step.lower(params, batch).compile()).dot_flops
    whole = automap.measure(jax.jit(_sgd(_recurrent)).lower(params, batch).compile()).dot_flops
    assert ours * 8 <= whole  # 2,048 vs 28,672 (replicated, as before: 28,672)


@pytest.mark.parametrize("front, overrides", [
    ("linen", dict()), ("nnx", dict(scan=True)), ("linen", dict(dropout=0.1, scan=True)),
], ids=["linen", "nnx-scan", "linen-dropout"])
def test_gpt_tokens_and_targets_split_on_dim_0_not_the_sequence(front, overrides):
    # batch == seq: only the flow tells them apart (the sequence dim meets the position embedding)
    cfg = zoo.GPTConfig(layers=1, vocab=64, seq=16, d_model=32, heads=4, batch=16, **overrides)
    w = (zoo.gpt_linen if front == "linen" else zoo.gpt_nnx)(cfg)
    state, batch = w.abstract()
    mesh = automap.make_mesh({"data": 8})
    plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.data_parallel("data")]).plan(state, batch)
    specs = {p: plan.state.partition_spec(v) for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)}
    assert specs["batch/tokens"] == P("data") and specs["batch/targets"] == P("data")
    assert "data_parallel('data'): batch dims batch/targets[0], batch/tokens[0]" in plan.notes
    if cfg.dropout:  # the dropout key has no batch dim: left whole, with a note
        assert specs["batch/rng"] == P()
        assert any("batch/rng has no batch dim" in n for n in plan.notes), plan.notes
    assert all(spec == P() for p, spec in specs.items() if p.startswith("state/"))


def test_data_parallel_after_megatron_composes():
    # the batch split on `data`, the weights on `model`: both tactics in one schedule
    w = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(64, 64, 64), d_out=16, batch=8))
    state, batch = w.abstract()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    plan = automap.automap(w.train_step, mesh=mesh,
                           tactics=[tactics.megatron("model"), tactics.data_parallel("data")]).plan(state, batch)
    specs = {p: plan.state.partition_spec(v) for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)}
    assert specs["batch/x"] == P("data") and specs["batch/y"] == P("data")
    assert specs["state/params/layers_0/kernel"] == P(None, "model")
