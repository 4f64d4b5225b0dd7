"""fsdp / zero: which leaves are sharded where, per-device state bytes (plan and XLA), the
compiled gradient collectives per ZeRO stage, numerics, and the cases where nothing applies."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import tree_util
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo

GPT = dict(layers=2, d_model=32, heads=4, vocab=64, seq=16, batch=8)


@functools.cache
def _workload(kind: str, scan: bool = False):
    """(workload, concrete state, batch, unsharded loss), built once per module run."""
    w = zoo.gpt_linen(zoo.GPTConfig(scan=scan, **GPT)) if kind == "gpt" else zoo.mlp(zoo.MLPConfig())
    state, batch = w.init(0)
    return w, state, batch, float(jax.jit(w.loss_fn)(state["params"], batch))


def _context(plan) -> tactics.PlanContext:
    program = plan.program
    state_in = tuple(v for v, p in zip(program.inputs, program.input_paths, strict=True) if p.startswith("state/"))
    data_in = tuple(v for v in program.inputs if v not in state_in)
    return tactics.PlanContext(program, dict(plan.state.axes), data_in, state_in)


def _run(step, plan, state, batch):
    """Compile once, measure it, and run that executable: (measurement, flat outputs)."""
    compiled = step.lower(state, batch).compile()
    args = jax.device_put((state, batch), plan.in_shardings)
    return automap.measure(compiled), compiled(*jax.tree.leaves(args))


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(e[0] if isinstance(e, tuple) and len(e) == 1 else e for e in entries)


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_fsdp_gpt(scan):
    w, state, batch, ref_loss = _workload("gpt", scan)
    mesh = automap.make_mesh({"data": 8})
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.fsdp("data")])
    plan = step.plan(state, batch)
    program, ctx = plan.program, _context(plan)

    # every parameter and optimizer-state leaf gets the expert FSDP spec (largest divisible dim,
    # never the stacked layers dim); the batch is split on `data`
    expert = tree_util.tree_leaves(zoo.experts.fsdp(state, batch, mesh), is_leaf=lambda x: isinstance(x, P))
    for path, vid, want in zip(program.input_paths, program.inputs, expert, strict=True):
        ndim = program.values[vid].ndim
        assert _norm(plan.state.partition_spec(vid), ndim) == _norm(want, ndim), path
    if scan:
        stacked = [v for v, p in zip(program.inputs, program.input_paths, strict=True) if "/blocks/" in p]
        assert stacked and all(plan.state.spec(v)[0] == () for v in stacked)
    roles = tactics.state_roles(ctx)
    assert len(roles.params) == len(roles.grads) == (len(roles.opt_state) - 1) // 2  # Adam mu, nu + count
    assert all(plan.state.shards(v) == 8 for v in roles.grads)
    assert plan.reasons[roles.params[0]].startswith("fsdp('data'): dim ")
    assert any("1 small leaves replicated" in n for n in plan.notes)  # the Adam step count

    # per-device parameter + optimizer-state bytes: total / 8 (the plan and XLA agree)
    total = sum(program.values[v].nbytes for v in ctx.state_inputs)
    planned = sum(plan.state.bytes_per_device(v) for v in ctx.state_inputs)
    assert total / 8 <= planned <= 1.01 * total / 8
    measured, outs = _run(step, plan, state, batch)
    batch_bytes = sum(plan.state.bytes_per_device(v) for v in ctx.data_inputs)
    assert total / 8 <= measured.memory.argument - batch_bytes <= 1.01 * total / 8

    # activations stay batch-sharded: every dot output carrying the batch dim is split on `data`
    dots = [v for v in program.values if v.name.endswith("dot_general") and v.shape[:1] == (GPT["batch"],)]
    assert dots and all(plan.state.spec(v.id)[0] == ("data",) for v in dots)
    np.testing.assert_allclose(outs[-1], ref_loss, rtol=1e-5)


def test_scan_stacked_dim_never_sharded_even_when_largest():
    # layers == d_model == 8: the stacked dim ties for largest (and comes first) on every leaf
    w = zoo.gpt_linen(zoo.GPTConfig(layers=8, d_model=8, heads=2, vocab=16, seq=8, batch=8, scan=True))
    plan = automap.automap(w.train_step, mesh=automap.make_mesh({"data": 8}), tactics=[tactics.fsdp()]).plan(
        *w.abstract())
    program = plan.program
    stacked = [v for v, p in zip(program.inputs, program.input_paths, strict=True) if "/blocks/" in p]
    assert len(stacked) == 3 * 12  # params, mu, nu
    for v in stacked:
        shape, spec = program.values[v].shape, plan.state.spec(v)
        divisible = any(n % 8 == 0 for n in shape[1:])
        assert spec[0] == () and (("data",) in spec) == divisible, (program.values[v], spec)
    assert sum(("data",) in plan.state.spec(v) for v in stacked) >= 3 * 10


# stage -> (parameters sharded, gradients sharded, compiled gradient collective)
ZERO = [
    (1, False, False, "all-reduce"),
    (2, False, True, "reduce-scatter"),
    (3, True, True, "reduce-scatter"),
]


@pytest.mark.parametrize("stage,params_sharded,grads_sharded,kind", ZERO)
def test_zero_stages(stage, params_sharded, grads_sharded, kind):
    w, state, batch, ref_loss = _workload("mlp")
    mesh = automap.make_mesh({"data": 8})
    # pins="all" without the arbiter compiles the plan as planned: left free (and the arbiter
    # keeps the program XLA measures better) XLA sees that stage 1's all-reduced gradient is
    # only ever used through each device's slice and makes the all-reduce + slice a
    # reduce-scatter (stage 2's collective) on its own, and stage 3 gathers activations
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.zero(stage)], pins="all", arbiter=None)
    plan = step.plan(state, batch)
    roles = tactics.state_roles(_context(plan))
    assert len(roles.params) == len(roles.grads) == 6 and len(roles.opt_state) == 13
    shards = plan.state.shards
    assert all((shards(v) == 8) == params_sharded for v in roles.params)
    assert all(shards(v) == 8 for v in roles.opt_state if plan.program.values[v].ndim)
    assert all((shards(v) == 8) == grads_sharded for v in roles.grads)
    # each moment has its parameter's spec (same dim, same axis) whatever the stage
    fsdp_plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.fsdp()]).plan(state, batch)
    assert all(plan.state.spec(v) == fsdp_plan.state.spec(v) for v in roles.opt_state)

    grad_bytes = sum(plan.program.values[v].nbytes for v in roles.grads)
    # the cost model's view: the gradient sums are all-reduced (stage 1) or reduce-scattered
    planned = {r.kind for r in plan.reshards if plan.program.values[r.value].phase == "backward"}
    assert planned & {"all-reduce", "reduce-scatter"} == {kind}
    measured, outs = _run(step, plan, state, batch)
    got = measured.collectives
    assert got[kind].bytes >= grad_bytes
    other = "all-reduce" if kind == "reduce-scatter" else "reduce-scatter"
    assert other not in got or got[other].bytes < 0.01 * grad_bytes  # only the global norm's scalars

    # the sharded update computes the unsharded step
    ref_state, _ = _reference_step()
    np.testing.assert_allclose(outs[-1], ref_loss, rtol=1e-5)
    for a, b in zip(outs[:-1], jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _zero3_by_hand(state, batch, mesh):
    """An expert's ZeRO-3 over the whole mesh: each state leaf's largest dim (first on ties) that
    the mesh size divides, split over all of its axes (replicated where none is); the batch's dim
    0 over all of them."""
    axes, n = tuple(mesh.axis_names), mesh.size

    def spec(leaf):
        dims = [d for d, k in enumerate(leaf.shape) if k % n == 0]
        if not dims:
            return P()
        best = max(dims, key=lambda d: (leaf.shape[d], -d))
        return P(*[axes if d == best else None for d in range(leaf.ndim)])
    named = functools.partial(jax.sharding.NamedSharding, mesh)
    return (jax.tree.map(lambda leaf: named(spec(leaf)), state), jax.tree.map(lambda leaf: named(P(axes)), batch))


def test_fsdp_over_two_axes_jointly_is_the_hand_written_zero3():
    """fsdp(('data', 'model')) splits each leaf's one dim over both axes (fsdp('data') then
    fsdp('model') splits two dims): the specs, XLA's measure and the numerics of the hand plan."""
    w, state, batch, ref_loss = _workload("mlp")
    mesh = automap.make_mesh({"data": 2, "model": 4})
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.fsdp(("data", "model"))], search=None)
    plan = step.plan(state, batch)
    hand = _zero3_by_hand(state, batch, mesh)
    for path, vid, got, want in zip(plan.program.input_paths, plan.program.inputs, jax.tree.leaves(plan.in_shardings),
                                    jax.tree.leaves(hand), strict=True):
        ndim = plan.program.values[vid].ndim
        assert _norm(got.spec, ndim) == _norm(want.spec, ndim), path
    assert plan.reasons[plan.program.inputs[-1]] == "data_parallel('data'): batch dim 0"
    assert any("6 parameters and 12 optimizer-state leaves sharded on ('data', 'model') jointly" in n
               for n in plan.notes), plan.notes
    again = tactics.fsdp(("data", "model"))(_context(plan), plan.state)  # a second time: nothing left to do
    assert again.state is plan.state and again.notes[-1].endswith("(already sharded on the axis); nothing done")
    measured, outs = _run(step, plan, state, batch)
    by_hand = automap.measure(jax.jit(w.train_step, in_shardings=hand).lower(state, batch).compile())
    assert (measured.wire_bytes, measured.memory_per_device) == (by_hand.wire_bytes, by_hand.memory_per_device)
    ref_state, _ = _reference_step()
    np.testing.assert_allclose(outs[-1], ref_loss, rtol=1e-5)
    for a, b in zip(outs[:-1], jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _gru_classifier():
    """(step, params, batch): an equinox GRU reading each image's rows, its last state into an
    8-class linear head (weight (8, 32): its largest dim the contracted one), SGD."""
    import equinox as eqx

    class GRUClassifier(eqx.Module):
        gru: eqx.nn.GRUCell
        head: eqx.nn.Linear

        def __call__(self, image):  # (channels, rows, columns): each row's channels x columns one input
            rows = image.transpose(1, 0, 2).reshape(image.shape[1], -1)
            state, _ = jax.lax.scan(lambda h, row: (self.gru(row, h), None), jnp.zeros(32), rows)
            return self.head(state)

    k1, k2 = jax.random.split(jax.random.key(0))
    params, static = eqx.partition(GRUClassifier(eqx.nn.GRUCell(128, 32, key=k1), eqx.nn.Linear(32, 8, key=k2)),
                                   eqx.is_inexact_array)

    def loss(params, batch):
        logits = jax.vmap(eqx.combine(params, static))(batch["image"])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["labels"][:, None], 1))

    def step(params, batch):
        value, g = jax.value_and_grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), value

    rng = np.random.RandomState(0)
    batch = {"image": jnp.asarray(rng.randn(8, 16, 8, 8).astype(np.float32)),
             "labels": jnp.asarray(rng.randint(0, 8, 8).astype(np.int32))}
    return step, params, batch


def test_fsdp_over_two_axes_takes_the_leading_dims_where_the_cost_model_finds_them_leaner():
    """The head's weight (8, 32) split on its largest dim (the one contracted with the GRU's
    state): XLA's propagation from the inputs splits that state on it, and the step measured
    171,064 B per device; on its leading dim (the classes) 47,160 B. The cost model sees it (in
    the layout XLA propagates) and the tactic keeps the leading dims; the step is unchanged."""
    step, params, batch = _gru_classifier()
    mesh = automap.make_mesh({"data": 2, "model": 4})
    sharded = automap.automap(step, mesh=mesh, tactics=[tactics.fsdp(("data", "model"))], search=None)
    plan = sharded.plan(params, batch)
    leading = "fsdp(('data', 'model')): each leaf's leading free dim, not its largest"
    assert any(n.startswith(leading) for n in plan.notes), plan.notes
    specs = jax.tree.map(lambda s: tuple(s.spec), plan.in_shardings[0])
    axes = ("data", "model")
    assert (specs.head.weight, specs.head.bias, specs.gru.weight_ih) == ((axes,), (axes,), (axes,))
    measured, outs = _run(sharded, plan, params, batch)
    by_hand = automap.measure(jax.jit(step, in_shardings=_zero3_by_hand(params, batch, mesh)).lower(
        params, batch).compile())  # the largest dims
    assert measured.memory_per_device < 0.5 * by_hand.memory_per_device, (measured.memory_per_device,
                                                                           by_hand.memory_per_device)
    ref = jax.jit(step)(params, batch)
    for a, b in zip(outs, jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@functools.cache
def _reference_step():
    w, state, batch, _ = _workload("mlp")
    return jax.jit(w.train_step)(state, batch)


def _odd_mlp():
    """A model none of whose parameter dims the data axis divides."""
    w = zoo.mlp(zoo.MLPConfig(d_in=3, hidden=(5,), d_out=7, batch=8))
    return w, *w.abstract()


# tactic, mesh, expected note
CANNOT = [
    (tactics.fsdp("data"), {"data": 8}, "no free dim divisible by 8"),
    (tactics.zero(2, "data"), {"data": 8}, "no free dim divisible by 8"),
]


@pytest.mark.parametrize("tactic,axes,note", CANNOT)
def test_cannot_apply_leaves_state_unchanged(tactic, axes, note):
    w, state, batch = _odd_mlp()
    mesh = automap.make_mesh(axes)
    plan = automap.automap(w.train_step, mesh=mesh, tactics=[tactic]).plan(state, batch)
    before = automap.automap(w.train_step, mesh=mesh, tactics=[]).plan(state, batch)
    assert dict(plan.state.specs) == dict(before.state.specs)
    assert all(plan.state.shards(v) == 1 for v in plan.program.inputs)
    assert any(note in n and "nothing done" in n for n in plan.notes), plan.notes


def test_zero_rejects_bad_stage():
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        tactics.zero(4)
