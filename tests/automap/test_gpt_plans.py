"""Acceptance: expert plans given as manual rules on the zoo GPT (linen and nnx, scanned and not).

Megatron specs on the parameters alone (plus the batch on ``data``) must propagate to every
value (optimizer state included), give the unsharded loss, and compile to the same collective
bytes as the same specs handed to ``jax.jit`` directly. FSDP specs must compile to fewer
collective bytes than ``jax.jit`` given the parameter specs alone (no activation constraints).
"""
import jax
import numpy as np
import pytest
from jax import tree_util
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap import zoo

CFG = dict(layers=2, vocab=64, seq=16, d_model=32, heads=4, batch=8)


def _is_spec(x):
    return isinstance(x, P)


def _param_rules(state_specs):
    """Exact-path manual rules for the sharded parameters only (not the optimizer state)."""
    rules = []
    for path, spec in tree_util.tree_flatten_with_path(state_specs["params"], is_leaf=_is_spec)[0]:
        if any(e is not None for e in spec):
            rules.append(("^state/params/" + "/".join(str(k.key) for k in path) + "$", spec))
    return rules + [(r"^batch/(tokens|targets)$", P("data"))]


def _norm(spec, ndim):
    entries = tuple(spec) + (None,) * (ndim - len(tuple(spec)))
    return tuple(e if not isinstance(e, tuple) or len(e) != 1 else e[0] for e in entries)


def _workload(kind, scan):
    cfg = zoo.GPTConfig(scan=scan, **CFG)
    return (zoo.gpt_linen if kind == "linen" else zoo.gpt_nnx)(cfg)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_megatron_from_parameter_specs(kind, scan):
    w = _workload(kind, scan)
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 2, "model": 4})
    state_specs, batch_specs = zoo.experts.megatron(state, batch, mesh)
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.manual(_param_rules(state_specs))])
    plan = step.plan(state, batch)
    program = plan.program

    # every parameter and optimizer-state leaf gets exactly the expert spec
    expert = tree_util.tree_leaves((state_specs, batch_specs), is_leaf=_is_spec)
    for path, vid, want in zip(program.input_paths, program.inputs, expert, strict=True):
        ndim = program.values[vid].ndim
        assert _norm(plan.state.partition_spec(vid), ndim) == _norm(want, ndim), path

    # every live activation carrying the batch is split over `data`, attention scores over heads too
    used = {v for op in program.all_ops for v in op.linked_inputs}
    # constants (a scalar broadcast) carry no batch data: their layout is free
    constants = {v for op in program.all_ops if op.primitive == "broadcast_in_dim"
                 and program.values[op.inputs[0]].ndim == 0 for v in op.outputs}
    live = [
        v for v in program.values
        if v.kind in ("intermediate", "region_input") and v.ndim >= 2 and v.shape[0] == CFG["batch"]
        and v.phase in ("forward", "backward") and v.id in used and v.id not in constants
    ]
    assert len(live) > 100
    assert all("data" in plan.state.spec(v.id)[0] for v in live), [v for v in live if not plan.state.spec(v.id)[0]][:5]
    scores = [v for v in live if v.shape[1:] == (CFG["heads"], CFG["seq"], CFG["seq"])]
    assert scores and all(plan.state.spec(v.id)[1] == ("model",) for v in scores)

    # the emitted program computes the unsharded step
    new_state, loss = step(state, batch)
    ref_state, ref_loss = jax.jit(w.train_step)(state, batch)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    # updated state: Adam's first step divides by |g|, so entries whose gradient is ~0 may differ
    # by a fraction of the learning rate; everything else agrees to fp32 precision
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(ref_state), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-4)
    # and the parameters stay where the plan put them
    assert jax.tree.leaves(new_state)[0].sharding == jax.tree.leaves(plan.in_shardings)[0]

    # same collective bytes as the expert specs passed straight to jax.jit
    ours = automap.measure(step.lower(state, batch).compile())
    shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), (state_specs, batch_specs), is_leaf=_is_spec)
    theirs = automap.measure(jax.jit(w.train_step, in_shardings=shardings).lower(state, batch).compile())
    assert theirs.collective_bytes > 0
    assert abs(ours.collective_bytes - theirs.collective_bytes) <= 0.01 * theirs.collective_bytes


def test_fsdp_activation_constraints_beat_parameter_specs_alone():
    w = _workload("linen", False)
    state, batch = w.init(0)
    mesh = automap.make_mesh({"data": 8})
    state_specs, _ = zoo.experts.fsdp(state, batch, mesh)
    step = automap.automap(w.train_step, mesh=mesh, tactics=[tactics.manual(_param_rules(state_specs))])
    plan = step.plan(state, batch)
    # the activations stay batch-sharded: the pinned dot outputs carry `data` on their leading dim
    dots = [v for v in plan.program.values if v.name.endswith("dot_general") and v.shape[0] == CFG["batch"]]
    assert dots and all(plan.state.spec(v.id)[0] == ("data",) for v in dots)
    ours = automap.measure(step.lower(state, batch).compile())

    # jax.jit with the same parameter specs alone: no activation constraints, the rest replicated
    replicated = NamedSharding(mesh, P())
    params_only = (
        {"params": jax.tree.map(lambda s: NamedSharding(mesh, s), state_specs["params"], is_leaf=_is_spec),
         "opt_state": jax.tree.map(lambda _: replicated, state["opt_state"])},
        jax.tree.map(lambda _: replicated, batch),
    )
    theirs = automap.measure(jax.jit(w.train_step, in_shardings=params_only).lower(state, batch).compile())
    assert ours.collective_bytes < theirs.collective_bytes
    _, loss = step(state, batch)
    np.testing.assert_allclose(loss, jax.jit(w.train_step)(state, batch)[1], rtol=1e-5)
