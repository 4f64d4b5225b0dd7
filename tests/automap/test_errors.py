"""Bad input gets a clear error, nothing silently wrong: each error names what was wrong, where,
and what to do."""
import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap.rules import MissingRuleError, MissingRuleWarning, derive

MESH = automap.make_mesh({"data": 2, "model": 4})
F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def step(params, batch):
    return jnp.tanh(batch["x"] @ params["w"]).sum()


PARAMS = {"w": np.ones((16, 6), np.float32)}
BATCH = {"x": np.ones((8, 16), np.float32)}


def plan_with(rules):
    return automap.partition(step, mesh=MESH, tactics=[tactics.manual(rules)]).plan(PARAMS, BATCH)


def raises(exc, *fragments):
    """pytest.raises(exc) whose message contains every fragment (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ---------------------------------------------------------------------------- PartitionSpecs

@pytest.mark.parametrize("rules, fragments", [
    # an unknown mesh axis: names the axis, the input, the mesh's axes
    ({"w": P(None, "modle")}, ["'modle'", "params/w", "('data', 'model')", "use one of those"]),
    ({"x": P(("data", "modle"))}, ["'modle'", "batch/x", "('data', 'model')"]),
    # a dim the axis does not divide: names the input, dim, size, axis and the fix
    ({"w": P(None, "model")}, ["params/w", "dim 1", "size 6", "not divisible by 4", "('model',)",
                               "choose an axis that divides it or pad"]),
    ({"x": P(("data", "model"), None)} | {"w": P(None, ("data", "model"))},
     ["params/w", "dim 1", "size 6", "not divisible by 8", "('data', 'model')", "manual rule 'w'"]),
    # a mesh axis twice in one spec
    ({"w": P("data", "data")}, ["params/w", "'data' twice", "at most one dim", "remove one"]),
    ({"x": P(("model", "model"))}, ["batch/x", "'model' twice"]),
    # more entries than dims
    ({"w": P(None, None, "model")}, ["params/w", "3 entries", "only 2 dims", "at most 2 entries"]),
])
def test_bad_partition_spec(rules, fragments):
    with raises(automap.ShardingError, *fragments):
        plan_with(rules)


def test_axes_of_one_dim_are_checked_together():
    # 'data' (2) and 'model' (4) each divide 12, both together (8) do not
    f = automap.partition(lambda w: w * 2, mesh=MESH, tactics=[tactics.manual({"w": P(None, ("data", "model"))})])
    with raises(automap.ShardingError, "'w'", "size 12", "not divisible by 8", "('data', 'model')", "manual rule"):
        f.plan(sds(4, 12))


def test_manual_spec_is_honoured_exactly():
    # the batch rule propagates to b (b + x); b's own rule still decides b's spec exactly
    def fn(params, x):
        return {"b": params["b"] * 2}, (x + params["b"]).sum()

    for pspec in (P("model"), P(None, "data"), P()):
        f = automap.partition(fn, mesh=MESH, tactics=[tactics.manual({"b": pspec, "x": P("data")})])
        plan = f.plan({"b": sds(8, 16)}, sds(8, 16))
        assert plan.in_shardings[0]["b"].spec == pspec
        assert plan.out_shardings[0]["b"].spec == pspec
        assert plan.in_shardings[1].spec == P("data")


def test_sharding_error_is_a_value_error():
    assert issubclass(automap.ShardingError, ValueError)
    with pytest.raises(ValueError):
        plan_with({"w": P("nope")})


def test_manual_rule_must_be_a_partition_spec():
    with raises(TypeError, "'w'", "PartitionSpec", "'model'"):
        tactics.manual({"w": "model"})
    with pytest.raises(re.error):
        tactics.manual({"w[": P()})


def test_manual_rule_matching_nothing_warns_with_the_paths():
    with pytest.warns(UserWarning, match=r"'kernel' matched no input path.*params/w, batch/x"):
        plan = plan_with({"kernel": P(None, "model"), "x": P("data")})
    assert plan.state.spec(plan.program.inputs[1]) == (("data",), ())


# ---------------------------------------------------------------------------- missing rules

_mystery_p = Primitive("automap_test_mystery")
_mystery_p.def_impl(lambda x: x)
_mystery_p.def_abstract_eval(lambda x: jax.core.ShapedArray(x.shape, x.dtype))
mlir.register_lowering(_mystery_p, mlir.lower_fun(lambda x: x, multiple_results=False))


def _uses_mystery(w, x):
    h = x @ w
    return _mystery_p.bind(h).sum()  # the line the error must name


MYSTERY_LINE = _uses_mystery.__code__.co_firstlineno + 2


def _mystery_in_scan(ws, x):
    def body(h, w):
        return _mystery_p.bind(h @ w), None

    return jax.lax.scan(body, x, ws)[0].sum()


@pytest.fixture
def no_derivation(monkeypatch):
    """XLA partitions the mystery op's lowering (an identity), so automap would derive its rule;
    these tests are about a primitive for which no rule can be derived."""
    monkeypatch.setattr(derive, "derive_rule", lambda *a: derive.Derivation(None, "switched off in this test"))


def test_missing_rule_in_strict_mode_names_primitive_and_line(no_derivation):
    f = automap.partition(_uses_mystery, mesh=MESH, strict=True)
    with raises(MissingRuleError, "'automap_test_mystery'", f"test_errors.py:{MYSTERY_LINE}", "_uses_mystery",
                "automap.rules.register", "strict=False"):
        f.plan(sds(16, 16), sds(8, 16))
    assert issubclass(MissingRuleError, NotImplementedError)


def test_missing_rule_inside_a_scan_body_in_strict_mode(no_derivation):
    f = automap.partition(_mystery_in_scan, mesh=MESH, strict=True)
    with raises(MissingRuleError, "'automap_test_mystery'", "test_errors.py", "body"):
        f.plan(sds(3, 16, 16), sds(8, 16))


def test_missing_rule_otherwise_warns_and_replicates_around_it(no_derivation):
    w, x = np.eye(16, dtype=np.float32), np.arange(128, dtype=np.float32).reshape(8, 16)
    f = automap.partition(_uses_mystery, mesh=MESH, search=None)
    with pytest.warns(MissingRuleWarning, match=rf"'automap_test_mystery' \(value .*, at .*test_errors.py:{MYSTERY_LINE}.*register"):
        plan = f.plan(w, x)
    (op,) = [op for op in plan.program.all_ops if op.primitive == "automap_test_mystery"]
    assert not op.has_rule
    # the batch-split operand is gathered in front of the op, its result is whole
    assert plan.state.spec(op.inputs[0]) == (("data", "model"), ())
    assert plan.state.spec(op.outputs[0]) == ((), ())
    assert [(r.kind, r.axes, r.value) for r in plan.reshards if r.op == op.id] == [
        ("all-gather", ("data", "model"), op.inputs[0])]
    assert "replicated around (no factor rule): automap_test_mystery" in plan.report()
    # and the program still computes the right thing
    np.testing.assert_allclose(float(f(w, x)), float(x.sum()), rtol=1e-6)


# ---------------------------------------------------------------------------- arguments vs plan

@pytest.fixture(scope="module")
def fixed():
    plan = automap.partition(step, mesh=MESH).plan(PARAMS, BATCH)
    return automap.automap(step, mesh=MESH, plan=plan)


@pytest.mark.parametrize("args, fragments", [
    # an extra leaf, a missing leaf, a renamed leaf
    (({"w": PARAMS["w"], "b": np.ones(6, np.float32)}, BATCH), ["unexpected 'params/b'"]),
    ((PARAMS, {}), ["missing 'batch/x'"]),
    ((PARAMS, {"inputs": BATCH["x"]}), ["missing 'batch/x'", "unexpected 'batch/inputs'"]),
    (((PARAMS["w"],), BATCH), ["missing 'params/w'", "unexpected 'params/0'"]),
    # a list where the plan had a dict of the same paths is still a different structure
    ((PARAMS, [BATCH["x"]]), ["missing 'batch/x'", "unexpected 'batch/0'"]),
    # the number of arguments
    ((PARAMS,), ["takes 2 arguments (params, batch), got 1"]),
    ((PARAMS, BATCH, BATCH), ["takes 2 arguments (params, batch), got 3"]),
])
def test_arguments_of_another_structure(fixed, args, fragments):
    with raises(ValueError, "structure the plan was made for", *fragments, "plan:", "given:",
                "pass arguments of the planned structure"):
        fixed(*args)
    with raises(ValueError, *fragments):
        fixed.lower(*args)
    with raises(ValueError, *fragments):
        fixed.plan(*args)


@pytest.mark.parametrize("x, fragments", [
    (np.ones((4, 16), np.float32), ["'batch/x'", "shape (4, 16)", "(8, 16) float32"]),
    (np.ones((8, 16), np.int32), ["'batch/x'", "dtype int32", "(8, 16) float32"]),
    (sds(8, 16, dtype=jnp.bfloat16), ["'batch/x'", "bfloat16", "(8, 16) float32"]),
    (np.ones((8, 16, 1), np.float32), ["'batch/x'", "(8, 16, 1)"]),
])
def test_wrong_shape_or_dtype_against_a_fixed_plan(fixed, x, fragments):
    with raises(ValueError, *fragments, "replan"):
        fixed.plan(PARAMS, {"x": x})
    assert fixed.plan(PARAMS, BATCH) is fixed._fixed_plan


def test_fixed_plan_on_another_mesh():
    plan = automap.partition(step, mesh=MESH).plan(PARAMS, BATCH)
    other = automap.make_mesh({"data": 4, "model": 2})
    with raises(ValueError, "{'data': 2, 'model': 4}", "{'data': 4, 'model': 2}", "mesh=plan.mesh"):
        automap.automap(step, mesh=other, plan=plan)


def test_fixed_plan_runs_matching_arguments(fixed):
    np.testing.assert_allclose(float(fixed(PARAMS, BATCH)), float(step(PARAMS, BATCH)), rtol=1e-6)


def test_calling_with_abstract_arguments():
    f = automap.partition(step, mesh=MESH)
    with raises(TypeError, "ShapeDtypeStruct", ".plan()", ".lower()"):
        f(PARAMS, {"x": sds(8, 16)})


def test_mesh_with_too_many_devices():
    with raises(ValueError, "{'data': 4, 'model': 4}", "needs 16 devices", "8 are available",
                "xla_force_host_platform_device_count=16"):
        automap.make_mesh({"data": 4, "model": 4})


def test_no_warnings_on_a_clean_plan():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan_with({"w": P(None, "data"), "x": P("model")})


def test_static_argnums_out_of_range():
    f = automap.partition(lambda x, n: x * n, mesh=MESH, static_argnums=(3,))
    with raises(ValueError, "static_argnums=(3,)", "argument 3", "2 arguments were given"):
        f.plan(sds(8), 2)


def test_unhashable_static_argument():
    f = automap.partition(lambda x, n: x * len(n), mesh=MESH, static_argnums=(1,))
    with raises(TypeError, "static argument 1", "hashable", "list", "tuple instead of a list"):
        f.plan(sds(8), [1, 2])
    np.testing.assert_allclose(np.asarray(f(np.ones(8, np.float32), (1, 2))), 2.0)
