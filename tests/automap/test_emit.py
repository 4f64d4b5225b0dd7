"""automap.emit: the replayed program computes what the function computes, with the plan's
constraints (scan bodies included), remat kept, state shardings tied, inputs placed, donation."""
import dataclasses
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import emit

MESH = automap.make_mesh({"data": 2, "model": 4})


def rand(seed, *shape, scale=0.3):
    return (np.random.RandomState(seed).randn(*shape) * scale).astype(np.float32)


def close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6), a, b)


def collectives(compiled):
    return {k: (s.count, s.bytes) for k, s in automap.measure(compiled).collectives.items() if s.count}


def primitives(jaxpr):
    """Primitive names in a (closed) jaxpr, sub-jaxprs (scan bodies, remat, ...) included."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                    out |= primitives(sub)
    return out


# ---------------------------------------------------------------------------- a small model

def _scan_loss(params, x):
    def body(h, w):
        h = jax.checkpoint(lambda h: jnp.tanh(h @ w))(h)
        return h, h.sum()

    h, sums = jax.lax.scan(body, x, params["ws"])
    return (jax.nn.relu(h) @ params["out"]).mean() + 0.01 * sums.sum()


def _sgd_step(params, x):
    loss, g = jax.value_and_grad(_scan_loss)(params, x)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


SCAN_PARAMS = {"ws": rand(0, 3, 16, 16), "out": rand(1, 16, 4)}
SCAN_X = rand(2, 8, 16)
MANUAL = [tactics.manual({"ws": P(None, None, "model"), "out": P("model"), "x": P("data")})]


@pytest.mark.parametrize("pins", ["plan", "all", "anchors", "none"])
@pytest.mark.parametrize("tactic", [None, MANUAL], ids=["default", "manual"])
def test_numerics_equal_unsharded(pins, tactic):
    f = automap.partition(_sgd_step, mesh=MESH, pins=pins, tactics=tactic)
    plan = f.plan(SCAN_PARAMS, SCAN_X)
    got = f(SCAN_PARAMS, SCAN_X)
    close(got, jax.jit(_sgd_step)(SCAN_PARAMS, SCAN_X))
    if pins == "none":
        assert plan.pins == frozenset()
    else:  # the contractions at least ('plan': these plans decide their inputs only, but run a scan)
        assert plan.pins >= emit.pinned_values(plan.state, "anchors")
    if pins == "all":
        assert plan.pins >= emit.pinned_values(plan.state, "anchors")


def test_pins_by_policy():
    plan = automap.partition(_sgd_step, mesh=MESH, tactics=MANUAL).plan(SCAN_PARAMS, SCAN_X)
    program = plan.program
    anchors = emit.pinned_values(plan.state, "anchors")
    everything = emit.pinned_values(plan.state, "all")
    # the manual specs decide the inputs only: propagation from them is the plan; the program
    # runs a scan, where XLA's propagation can part from automap's, so the anchors are pinned
    assert not emit.decided_values(plan.state)
    assert plan.pins == emit.pinned_values(plan.state, "plan") >= anchors
    assert all(emit.unplanned(plan.state).spec(v) == plan.state.spec(v) for v in everything)
    assert {op.primitive for op in program.all_ops if set(op.outputs) & anchors} == {"dot_general"}
    assert anchors < everything
    # inputs are never pinned, scalars neither; a scan's results are (the scan is replayed, its
    # results are values like any other: 'all' pins the non-scalar ones)
    assert not everything & set(program.inputs)
    scans = [op for op in program.all_ops if op.primitive == "scan"]
    scan_results = {v for op in scans for v in op.outputs if program.value(v).ndim}
    assert scan_results and scan_results <= everything
    assert all(program.value(v).ndim for v in everything)


@pytest.mark.parametrize("loop", ["while", "cond"])
def test_values_inside_cond_and_while_are_not_claimed_as_pins(loop):
    # cond/while are re-bound as they were, so nothing inside them can carry a constraint
    def fn(w, x):
        if loop == "while":
            h = jax.lax.while_loop(lambda c: c[0] < 3, lambda c: (c[0] + 1, jnp.tanh(c[1] @ w)), (0, x))[1]
        else:
            h = jax.lax.cond(x.sum() > 0, lambda a: jnp.tanh(a @ w), lambda a: a @ w, x)
        return (h @ w).sum(1)

    w, x = rand(0, 16, 16), rand(1, 8, 16)
    f = automap.partition(fn, mesh=MESH, pins="all")
    plan = f.plan(w, x)
    inside = {v.id for v in plan.program.values if v.region}
    assert inside and not plan.pins & inside
    assert {plan.program.value(v).name for v in plan.pins} == {"dot_general", "reduce_sum"}
    close(f(w, x), fn(w, x))


# ---------------------------------------------------------------------------- scan bodies

def _megatron_scan(p, x):
    def body(h, wv):
        w, v = wv
        return jnp.tanh(h @ w) @ v, None

    h, _ = jax.lax.scan(body, x, (p["w"], p["v"]))
    return h.sum()


MEGATRON = [tactics.manual({"w": P(None, None, "model"), "v": P(None, "model"), "x": P("data")})]


DM_, D_M = (("data",), ("model",)), (("data",), ())


@pytest.mark.parametrize("pins, body_pins", [
    # Megatron specs on the inputs: nothing decided past them, but a scan: the anchors pinned
    ("plan", [("dot_general", D_M), ("dot_general", DM_)]),
    ("all", [("dot_general", D_M), ("dot_general", DM_), ("tanh", DM_)]),
    ("anchors", [("dot_general", D_M), ("dot_general", DM_)]),
    ("none", []),
])
def test_constraints_inside_scan_body(pins, body_pins):
    layers = 3
    params = {"w": rand(0, layers, 16, 32), "v": rand(1, layers, 32, 16)}
    x = rand(2, 8, 16)
    f = automap.partition(_megatron_scan, mesh=MESH, pins=pins, tactics=MEGATRON)
    plan = f.plan(params, x)
    (scan,) = [op for op in plan.program.ops if op.primitive == "scan"]
    body_values = {v for op in scan.regions[0].ops for v in op.outputs}
    got = sorted((plan.program.value(v).name, plan.state.spec(v)) for v in plan.pins & body_values)
    assert got == body_pins
    # the constraints are in the lowered loop body (and, under 'all', one on the scan's result)
    lowered = f.lower(params, x)
    scan_results = len(plan.pins & set(scan.outputs))
    assert scan_results == (pins == "all")
    assert lowered.as_text().count("sdy.sharding_constraint") == len(body_pins) + scan_results
    # per layer, one all-reduce of the row-parallel partial sum (batch-split: 4 x 16 fp32) over
    # 'model'; one all-reduce of the loss over 'data'
    assert collectives(lowered.compile()) == {"all-reduce": (layers + 1, layers * 4 * 16 * 4 + 4)}
    close(f(params, x), _megatron_scan(params, x))


# ---------------------------------------------------------------------------- pins by plan decision

def _exp_matmul(x, w):
    return jnp.exp(x) @ w


def _split_exp_plan(policy):
    """x batch-split on data, w replicated; then the plan decides to split ``exp(x)``'s features
    over model too (a decision on an activation): the contraction runs split and its (4, 4) f32
    partial result is all-reduced over model."""
    from automap.propagate import apply
    from automap.shardings import Action

    manual = [tactics.manual({"x": P("data"), "w": P()})]
    plan = automap.partition(_exp_matmul, mesh=MESH, tactics=manual, search=None).plan(EXP_X, EXP_W)
    (h,) = [op.outputs[0] for op in plan.program.ops if op.primitive == "exp"]
    state = apply(plan.state, [Action(h, 1, "model")], label="split exp over model")
    return dataclasses.replace(plan, state=state, pins=emit.pinned_values(state, policy)), h


EXP_X, EXP_W = rand(0, 8, 16), rand(1, 16, 4)


@pytest.mark.parametrize("policy, pinned, compiled", [
    ("plan", ["dot_general", "exp"], {"all-reduce": (1, 4 * 4 * 4)}),  # as planned (and estimated)
    ("anchors", ["dot_general"], {}),  # the decision is lost: exp computed whole over model
    ("none", [], {}),
])
def test_plan_pins_realise_a_decision_on_an_activation(policy, pinned, compiled):
    plan, h = _split_exp_plan(policy)
    assert emit.decided_values(plan.state) == {h}  # the dot is an output: fixed by out_shardings
    assert sorted(plan.program.value(v).name for v in plan.pins) == pinned
    step = automap.partition(_exp_matmul, mesh=MESH, plan=plan, arbiter=None)
    assert collectives(step.lower(EXP_X, EXP_W).compile()) == compiled
    # pinned, the plan is estimated as planned; with nothing pinned, in the layout XLA gives it (as compiled)
    want = [("all-reduce", ("model",), 64)] if pinned else []
    assert [(c.kind, c.axes, c.bytes) for c in plan.estimate.collectives] == want
    close(step(EXP_X, EXP_W), _exp_matmul(EXP_X, EXP_W))


def _scanned_tanh(x, w):
    return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=2)[0]


def test_jit_parity_binds_only_plans_that_decided_nothing_past_their_inputs(monkeypatch):
    """The arbiter holds the pinned program within 5% of jax.jit's in both figures
    (``arbitrate(..., reference="inputs-only")``) only for a plan that decided nothing past its
    inputs (pinned for its loop alone: what jax.jit makes of the same in_shardings); a plan that
    decided an activation keeps its own program in a trade of bytes for memory (the scanned zoo
    GPT's FSDP tactic plan: held to jax.jit's, it compiled to jax.jit's program, 1.9 MiB of memory
    per device against the 0.9 MiB it planned)."""
    import automap.api

    seen = []

    def spy(candidates, args, reference=None, budget=None):
        seen.append(reference)
        return arbitrate(candidates, args, reference=reference)

    arbitrate = automap.api.arbitrate
    monkeypatch.setattr(automap.api, "arbitrate", spy)
    manual = [tactics.manual({"x": P("data"), "w": P()})]
    x, w = rand(0, 8, 16), rand(1, 16, 16)
    scanned = automap.partition(_scanned_tanh, mesh=MESH, tactics=manual, search=None)
    assert scanned.plan(x, w).pins and not emit.decided_values(scanned.plan(x, w).state)
    close(scanned(x, w), _scanned_tanh(x, w))
    plan, _ = _split_exp_plan("plan")
    decided = automap.partition(_exp_matmul, mesh=MESH, plan=plan)
    close(decided(EXP_X, EXP_W), _exp_matmul(EXP_X, EXP_W))
    assert seen == ["inputs-only", None]


def test_replayed_ops_name_themselves_in_the_hlo():
    plan, _ = _split_exp_plan("plan")
    step = automap.partition(_exp_matmul, mesh=MESH, plan=plan, arbiter=None)
    text = step.lower(EXP_X, EXP_W).compile().as_text()
    dot = next(op for op in plan.program.ops if op.primitive == "dot_general")
    assert f'{emit.op_scope(dot)}/dot_general"' in text
    (all_reduce,) = [line for line in text.splitlines() if " all-reduce(" in line]
    assert emit.ops_of_metadata(all_reduce.split('op_name="')[1].split('"')[0]) == [dot.id]


def _fsdp_step(p, x):
    def loss(p):
        h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["w"])
        return h.sum()

    loss, g = jax.value_and_grad(loss)(p)
    return jax.tree.map(lambda a, b: a - 0.1 * b, p, g), loss


def test_fsdp_scan_collectives():
    layers, d = 3, 64
    mesh = automap.make_mesh({"data": 8})
    params, x = {"w": rand(0, layers, d, d, scale=0.1)}, rand(1, 16, d)
    f = automap.partition(_fsdp_step, mesh=mesh, tactics=[tactics.manual({"w": P(None, "data"), "x": P("data")})])
    plan = f.plan(params, x)
    assert plan.in_shardings[0]["w"].spec == P(None, "data")
    assert plan.out_shardings[0]["w"].spec == P(None, "data")
    # FSDP: each layer's weights gathered in the forward and again in the backward, their
    # gradients reduce-scattered, the loss all-reduced
    layer = d * d * 4
    assert collectives(f.lower(params, x).compile()) == {
        "all-gather": (2 * layers, 2 * layers * layer),
        "reduce-scatter": (layers, layers * layer),
        "all-reduce": (1, 4),
    }
    close(f(params, x), jax.jit(_fsdp_step)(params, x))


# ---------------------------------------------------------------------------- remat

def test_remat_is_preserved():
    def fn(w, x):
        return jax.checkpoint(lambda x: jnp.sin(jnp.tanh(x @ w)))(x).sum()

    w, x = rand(0, 16, 16), rand(1, 8, 16)
    for g in (fn, jax.grad(fn)):
        f = automap.partition(g, mesh=MESH)
        plan = f.plan(w, x)
        assert plan.program.remat_calls
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (w, x)]
        replayed = jax.make_jaxpr(emit.replay_fn(plan.state, MESH, plan.pins))(*abstract)
        assert primitives(replayed) & {"remat2", "checkpoint"}
        close(f(w, x), g(w, x))


def test_remat_inside_scan_is_preserved():
    # the search would drop it here, with memory to spare (tests/automap/test_unremat.py)
    plan = automap.partition(_sgd_step, mesh=MESH, keep_user_remat=True).plan(SCAN_PARAMS, SCAN_X)
    abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves((SCAN_PARAMS, SCAN_X))]
    replayed = jax.make_jaxpr(emit.replay_fn(plan.state, MESH, plan.pins))(*abstract)
    prims = primitives(replayed)
    assert "scan" in prims and prims & {"remat2", "checkpoint"}


# ---------------------------------------------------------------------------- state in, state out

OPT = optax.adam(1e-2)


def _mlp_loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return ((h @ params["w2"] - batch["y"]) ** 2).mean()


def _train_step(state, batch):
    loss, g = jax.value_and_grad(_mlp_loss)(state["params"], batch)
    updates, opt = OPT.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def _state():
    params = {"w1": rand(0, 16, 32), "b1": np.zeros(32, np.float32), "w2": rand(1, 32, 4)}
    return jax.tree.map(np.asarray, {"params": params, "opt": OPT.init(params)})


BATCH = {"x": rand(2, 8, 16, scale=1.0), "y": rand(3, 8, 4, scale=1.0)}
MEGATRON_MLP = [tactics.manual({"w1": P(None, "model"), "b1": P("model"), "w2": P("model"), "x": P("data"), "y": P("data")})]


@pytest.mark.parametrize("tactic", [None, MEGATRON_MLP], ids=["default", "megatron"])
def test_training_loop_never_reshards(tactic, monkeypatch):
    f = automap.partition(_train_step, mesh=MESH, tactics=tactic)
    plan = f.plan(_state(), BATCH)
    state_in, state_out = plan.in_shardings[0], plan.out_shardings[0]
    assert jax.tree.leaves(state_in) == jax.tree.leaves(state_out)
    if tactic is not None:
        assert state_out["params"]["w1"].spec == P(None, "model")
        assert state_out["opt"][0].mu["w2"].spec == P("model")
    assert plan.out_shardings[1].spec == P()

    state, ref = _state(), _state()
    batch = jax.tree.map(jax.device_put, BATCH, plan.in_shardings[1])
    state, loss = f(state, batch)  # the first call places the numpy state
    calls = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a) or real_put(*a, **k))
    for _ in range(3):
        ref, ref_loss = jax.jit(_train_step)(ref, BATCH)
        assert jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding == s, state, state_in)) == [True] * 10
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
        state, loss = f(state, batch)
    assert calls == []  # nothing was re-placed after the first step
    assert len(f._plans) == 1 and len(f._compiled) == 1


def test_unplaced_inputs_are_placed():
    f = automap.partition(_train_step, mesh=MESH, tactics=MEGATRON_MLP)
    plan = f.plan(_state(), BATCH)
    # numpy arrays, and a committed array on one device with the wrong sharding
    batch = dict(BATCH, x=jax.device_put(BATCH["x"], jax.devices()[3]))
    state, loss = f(_state(), batch)
    close((state, loss), jax.jit(_train_step)(_state(), BATCH))
    assert state["params"]["w1"].sharding == NamedSharding(MESH, P(None, "model"))
    assert plan.in_shardings[1]["x"].spec == P("data")


def test_donate_argnums():
    f = automap.partition(_train_step, mesh=MESH, donate_argnums=(0,))
    plan = f.plan(_state(), BATCH)
    state = jax.tree.map(jax.device_put, _state(), plan.in_shardings[0])
    batch = jax.tree.map(jax.device_put, BATCH, plan.in_shardings[1])
    new, _ = f(state, batch)
    assert all(a.is_deleted() for a in jax.tree.leaves(state))
    assert not any(a.is_deleted() for a in jax.tree.leaves(batch))
    assert not any(a.is_deleted() for a in jax.tree.leaves(new))


def test_donate_argnums_counts_static_args():
    def step(scale, state, batch):
        return jax.tree.map(lambda a: a * scale, state), batch["x"].sum()

    f = automap.partition(step, mesh=MESH, static_argnums=(0,), donate_argnums=(1,))
    state = {"w": jnp.ones((8, 4))}
    plan = f.plan(2.0, state, BATCH)
    state = jax.tree.map(jax.device_put, state, plan.in_shardings[0])
    batch = jax.tree.map(jax.device_put, BATCH, plan.in_shardings[1])
    new, total = f(2.0, state, batch)
    assert state["w"].is_deleted()
    assert not batch["x"].is_deleted()
    np.testing.assert_allclose(np.asarray(new["w"]), 2.0)
    np.testing.assert_allclose(float(total), BATCH["x"].sum(), rtol=1e-5)


def test_replayed_higher_order_ops_carry_debug_info():
    """A cond (any op with a jaxpr in its params) is replayed as a one-equation jaxpr; without debug
    info JAX deprecates it (a DeprecationWarning per replay, thousands in one default search)."""
    def step(w, x):
        return jax.lax.cond(x.sum() > 0, lambda v: jnp.sin(v @ w), lambda v: jnp.cos(v @ w), x).sum()

    w, x = rand(0, 8, 8), rand(1, 8, 8)
    sharded = automap.automap(step, mesh=MESH, tactics=[tactics.data_parallel("data")], search=None)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = sharded(w, x)
    assert not [r for r in record if "DebugInfo" in str(r.message)]
    close(out, step(w, x))
