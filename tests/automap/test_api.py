"""The public API: automap/partition, Partitioned (plan, lower, __call__, caching), Plan, make_mesh."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import automap
import tactics

MESH = automap.make_mesh({"data": 2, "model": 4})
F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def rand(seed, *shape):
    return (np.random.RandomState(seed).randn(*shape) * 0.3).astype(np.float32)


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"])
    return ((h @ params["w2"] - batch["y"]) ** 2).mean()


def step(params, batch):
    loss, g = jax.value_and_grad(_loss)(params, batch)
    return jax.tree.map(lambda a, b: a - 0.1 * b, params, g), loss


PARAMS = {"w1": rand(0, 16, 32), "w2": rand(1, 32, 4)}


def batch(n=8, seed=2):
    return {"x": rand(seed, n, 16), "y": rand(seed + 1, n, 4)}


def close(a, b):
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6), a, b)


# ---------------------------------------------------------------------------- forms

def test_decorator_and_partition_forms_agree():
    @automap.automap(mesh=MESH)
    def decorated(params, batch):
        return step(params, batch)

    called = automap.automap(step, mesh=MESH)
    partitioned = automap.partition(step, mesh=MESH)
    assert isinstance(decorated, automap.Partitioned)
    assert isinstance(partitioned, automap.Partitioned)
    assert decorated.__name__ == "decorated" and partitioned.__name__ == "step"
    want = jax.jit(step)(PARAMS, batch())
    for f in (decorated, called, partitioned):
        close(f(PARAMS, batch()), want)
    assert decorated.plan(PARAMS, batch()).in_shardings == partitioned.plan(PARAMS, batch()).in_shardings


def test_mesh_must_be_a_mesh():
    with pytest.raises(TypeError, match="automap.make_mesh"):
        automap.partition(step, mesh={"data": 2})


# ---------------------------------------------------------------------------- caching

def test_plans_are_cached_per_abstract_signature(monkeypatch):
    import automap.planner

    calls = []
    real = automap.planner.make_plan
    monkeypatch.setattr(automap.planner, "make_plan", lambda *a, **k: calls.append(1) or real(*a, **k))
    f = automap.partition(step, mesh=MESH)
    p1 = f.plan(PARAMS, batch())
    # arrays, ShapeDtypeStructs and a second call with other values: the same plan
    assert f.plan(jax.tree.map(lambda a: sds(*a.shape), PARAMS), batch(seed=5)) is p1
    f(PARAMS, batch())
    f(PARAMS, batch(seed=7))
    assert f.plan(PARAMS, batch()) is p1
    assert len(calls) == 1 and len(f._compiled) == 1
    # a new shape or dtype is a new signature
    p2 = f.plan(PARAMS, batch(16))
    p3 = f.plan(PARAMS, {"x": sds(8, 16, dtype=jnp.bfloat16), "y": sds(8, 4)})
    assert len({id(p1), id(p2), id(p3)}) == 3 and len(calls) == 3
    assert f.plan(PARAMS, batch(16)) is p2


def test_a_training_loop_goes_straight_to_the_compiled_program(monkeypatch):
    # after one call with the same structure, shapes and dtypes, a call neither plans nor checks
    # again: it places what is not laid out as planned (a fresh numpy batch) and runs
    f = automap.partition(step, mesh=MESH, search=None)
    params, value = f(PARAMS, batch())
    planned = f.plan(PARAMS, batch()).in_shardings[0]
    monkeypatch.setattr(f, "_prepare", lambda *a: pytest.fail("planned again"))
    ref, ref_value = jax.jit(step)(PARAMS, batch())
    close((params, value), (ref, ref_value))
    for seed in (3, 4):
        params, value = f(params, batch(seed=seed))
        ref, ref_value = jax.jit(step)(ref, batch(seed=seed))
        close((params, value), (ref, ref_value))
    assert params["w1"].sharding == planned["w1"] and params["w2"].sharding == planned["w2"]
    elsewhere = jax.device_put(batch(seed=5), jax.devices()[0])  # committed to other shardings: placed
    params, value = f(params, elsewhere)
    ref, ref_value = jax.jit(step)(ref, batch(seed=5))
    close((params, value), (ref, ref_value))
    with pytest.raises(pytest.fail.Exception, match="planned again"):  # another shape: the full path
        f(params, batch(16))


def test_static_args_are_part_of_the_signature():
    f = automap.partition(lambda x, n: x * n, mesh=MESH, static_argnums=(1,))
    x = rand(0, 8, 4)
    p2, p3 = f.plan(x, 2), f.plan(x, 3)
    assert p2 is not p3 and f.plan(x, 2) is p2
    np.testing.assert_allclose(np.asarray(f(x, 3)), x * 3, rtol=1e-6)
    assert p3.traced.in_paths == ("x",)


# ---------------------------------------------------------------------------- lower

def test_lower_returns_what_call_runs():
    f = automap.partition(step, mesh=MESH)
    b = batch()
    lowered = f.lower(PARAMS, b)
    assert isinstance(lowered, jax.stages.Lowered)
    # ShapeDtypeStructs lower the same program
    abstract = jax.tree.map(lambda a: sds(*a.shape), (PARAMS, b))
    assert f.lower(*abstract).as_text() == lowered.as_text()
    compiled = lowered.compile()
    plan = f.plan(PARAMS, b)
    flat_shardings = jax.tree.leaves(plan.in_shardings)
    flat = [jax.device_put(a, s) for a, s in zip(jax.tree.leaves((PARAMS, b)), flat_shardings, strict=True)]
    out = jax.tree.unflatten(plan.traced.out_tree, compiled(*flat))
    close(out, f(PARAMS, b))
    close(out, jax.jit(step)(PARAMS, b))
    assert list(compiled.input_shardings[0]) == flat_shardings


def test_call_rejects_abstract_arguments():
    f = automap.partition(step, mesh=MESH)
    with pytest.raises(TypeError, match=r"\.plan\(\) or \.lower\(\)"):
        f(PARAMS, jax.tree.map(lambda a: sds(*a.shape), batch()))


# ---------------------------------------------------------------------------- the plan

def test_plan_shardings_are_pytrees_of_named_shardings():
    plan = automap.partition(step, mesh=MESH, search=None).plan(PARAMS, batch())
    params_s, batch_s = plan.in_shardings
    assert set(params_s) == {"w1", "w2"} and set(batch_s) == {"x", "y"}
    assert all(isinstance(s, NamedSharding) and s.mesh == MESH for s in jax.tree.leaves(plan.in_shardings))
    new_params_s, loss_s = plan.out_shardings
    assert new_params_s == params_s  # fed back: the same sharding
    assert loss_s.spec == P()
    x = plan.program.inputs[plan.program.input_paths.index("batch/x")]
    assert plan.state.spec(x) == (("data", "model"), ())
    assert plan.state.partition_spec(x) == P(("data", "model"))


@pytest.mark.parametrize("axes, n, want", [
    ({"data": 2, "model": 4}, 8, ("data", "model")),
    ({"data": 2, "model": 4}, 16, ("data", "model")),
    ({"data": 2, "model": 4}, 4, ("data",)),  # 'model' would need 8 | 4
    ({"data": 2, "model": 4}, 6, ("data",)),
    ({"data": 2, "model": 4}, 3, ()),
    ({"model": 4, "data": 2}, 4, ("model",)),  # mesh order decides
    ({"a": 2, "b": 2, "c": 2}, 4, ("a", "b")),
    ({"one": 1, "data": 8}, 8, ("data",)),  # size-one axes are skipped
])
def test_without_search_the_batch_is_sharded_over_axes_that_divide_it(axes, n, want):
    mesh = automap.make_mesh(axes)
    plan = automap.partition(step, mesh=mesh, search=None).plan(PARAMS, batch(n))
    for name in ("x", "y"):
        pspec = P() if not want else P(want[0]) if len(want) == 1 else P(want)
        assert plan.in_shardings[1][name].spec == pspec
        assert plan.state.spec(plan.program.inputs[plan.program.input_paths.index(f"batch/{name}")])[0] == want
    # the parameters (fed back as outputs) are not data: they stay whole
    assert all(s.spec == P() for s in jax.tree.leaves(plan.in_shardings[0]))
    if not want:
        assert any("no data input" in note for note in plan.notes)


def test_report_lists_every_input_with_spec_bytes_and_collectives():
    f = automap.partition(step, mesh=MESH, tactics=[tactics.manual({"w1": P(None, "model"), "x": P("data")})])
    plan = f.plan(PARAMS, batch())
    text = plan.report()
    lines = text.splitlines()
    assert lines[0].startswith("automap plan on mesh data=2 x model=4 (8 devices)")
    rows = {line.split()[0]: line for line in lines[1:] if line.split() and "/" in line.split()[0]}
    assert set(rows) == {"params/w1", "params/w2", "batch/x", "batch/y"}
    assert "(-, model)" in rows["params/w1"] and "512 B" in rows["params/w1"]  # 16*32*4 / 4
    assert "manual 'w1'" in rows["params/w1"]
    assert "(data, -)" in rows["batch/x"] and "256 B" in rows["batch/x"]  # 8*16*4 / 2
    assert "(data, -)" in rows["batch/y"] and "propagated" in rows["batch/y"]
    assert "(model, -)" in rows["params/w2"]
    assert "collectives implied per step" in text
    kinds = {r.kind for r in plan.reshards}
    assert kinds and all(k in text for k in kinds)
    assert f"pinned intermediates: {len(plan.pins)}" in text


def test_report_with_no_collectives():
    plan = automap.partition(lambda x: x * 2 + 1, mesh=MESH).plan(sds(8, 4))
    assert "collectives implied per step: none" in plan.report()
    assert plan.reshards == ()


# ---------------------------------------------------------------------------- make_mesh

def test_make_mesh_axes_are_auto():
    mesh = automap.make_mesh({"data": 2, "model": 4})
    assert dict(mesh.shape) == {"data": 2, "model": 4}
    assert mesh.axis_names == ("data", "model")
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


def test_make_mesh_needs_enough_devices():
    with pytest.raises(ValueError, match=r"needs 16 devices but 8 are available.*xla_force_host_platform_device_count=16"):
        automap.make_mesh({"data": 4, "model": 4})
    with pytest.raises(ValueError, match="needs 4 devices but 2 are available"):
        automap.make_mesh({"data": 4}, devices=jax.devices()[:2])
