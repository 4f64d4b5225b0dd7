"""``tactics.manual`` (regex rules on input paths) and ``tactics.logical`` (flax logical axes)."""
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import tree_util
from jax.sharding import PartitionSpec as P

import automap
import tactics
from automap.shardings import ShardingError
from automap.zoo.train import init_state, make_optimizer, make_train_step

MESH = automap.make_mesh({"data": 2, "model": 4})


def _loss(params, batch):
    h = jnp.tanh(batch["x"] @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] - batch["y"]) ** 2)


def sgd_step(params, batch):
    loss, g = jax.value_and_grad(_loss)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, g), loss


_rng = np.random.default_rng(0)
PARAMS = {
    "w1": _rng.normal(size=(16, 12)).astype(np.float32),
    "b1": np.zeros(12, np.float32),
    "w2": _rng.normal(size=(12, 16)).astype(np.float32),
}
BATCH = {"x": _rng.normal(size=(8, 16)).astype(np.float32), "y": _rng.normal(size=(8, 16)).astype(np.float32)}


def plan_of(rules, schedule_after=()):
    step = automap.partition(sgd_step, mesh=MESH, tactics=[tactics.manual(rules), *schedule_after])
    return step, step.plan(PARAMS, BATCH)


def specs(plan):
    return {path: plan.state.partition_spec(v) for path, v in zip(plan.program.input_paths, plan.program.inputs, strict=True)}


def raises(exc, *fragments):
    """pytest.raises(exc) whose message contains every fragment (literally)."""
    return pytest.raises(exc, match="(?s)" + "".join(f"(?=.*{re.escape(f)})" for f in fragments))


# ---------------------------------------------------------------------------- manual: regex rules

@pytest.mark.parametrize("rules, want", [
    # a regex searched in the path; the rest follows by propagation (b1 with w1's column, w2 rows)
    ({r"w1$": P(None, "model"), r"^batch/": P("data")},
     {"params/w1": P(None, "model"), "params/b1": P("model"), "params/w2": P("model"),
      "batch/x": P("data"), "batch/y": P("data")}),
    # anchored exact paths
    ([(r"^params/w2$", P("model", None)), (r"^batch/x$", P("data", None))],
     {"params/w1": P(None, "model"), "params/b1": P("model"), "params/w2": P("model"),
      "batch/x": P("data"), "batch/y": P("data")}),
    # first match wins: params/w2 takes the first rule, not the second
    ([(r"params/w2", P("model")), (r"params/w", P(None, "model")), ("x", P("data"))],
     {"params/w1": P(None, "model"), "params/w2": P("model"), "params/b1": P("model"), "batch/x": P("data")}),
    ([(r"params/w", P(None, "model")), (r"params/w2", P("model"))],  # w2 takes P(None, model) here
     {"params/w1": P(None, "model"), "params/w2": P(None, "model"), "params/b1": P("model")}),
    # a tuple of mesh axes on one dim
    ({r"^batch/": P(("data", "model"))},
     {"batch/x": P(("data", "model")), "batch/y": P(("data", "model")), "params/w1": P(), "params/w2": P()}),
], ids=["regex", "exact", "first-wins", "first-wins-shadow", "axis-tuple"])
def test_manual_rules(rules, want):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the shadowed rule warns (tested below)
        step, plan = plan_of(rules)
    got = specs(plan)
    assert {k: got[k] for k in want} == want
    _, loss = step(PARAMS, BATCH)
    np.testing.assert_allclose(loss, jax.jit(sgd_step)(PARAMS, BATCH)[1], rtol=1e-5)


def test_unmatched_rule_warns_with_the_input_paths():
    with pytest.warns(UserWarning, match=r"manual rule 'w3' matched no input path.*params/w1.*batch/x"):
        _, plan = plan_of({"w1": P(None, "model"), "w3": P("model")})
    assert specs(plan)["params/w1"] == P(None, "model")


def test_shadowed_rule_warns():
    with pytest.warns(UserWarning, match=r"'params/w2' matched no input path"):
        plan_of([(r"params/w", P(None, "model")), (r"params/w2", P("model"))])


@pytest.mark.parametrize("rules, exc, fragments", [
    ({"w1": "model"}, TypeError, ["'w1'", "expected a jax.sharding.PartitionSpec", "'model'"]),
    ({"w1": ("model",)}, TypeError, ["expected a jax.sharding.PartitionSpec"]),
    ({"w[": P()}, re.error, []),
])
def test_manual_rejects_bad_rules_when_built(rules, exc, fragments):
    with raises(exc, *fragments):
        tactics.manual(rules)


@pytest.mark.parametrize("rules, fragments", [
    ({"w1": P(None, None, "model")}, ["params/w1", "3 entries", "only 2 dims"]),
    ({"w1": P("model", "model")}, ["params/w1", "'model' twice"]),
    ({"w1": P(None, "tensor")}, ["'tensor'", "params/w1", "('data', 'model')"]),
    ({"b1": P(("data", "model", "model"))}, ["params/b1", "'model' twice"]),
    ({"b1": P(("data", "model"))}, ["params/b1", "dim 0", "size 12", "not divisible by 8"]),
    ({"^batch/x$": P("data"), "^batch/y$": P("data", "data")}, ["batch/y", "'data' twice"]),
])
def test_manual_partition_spec_errors(rules, fragments):
    with raises(ShardingError, *fragments):
        plan_of(rules)


def test_frozen_specs_are_not_changed_by_propagation():
    # w2 unpinned: the column w1 makes it row-parallel
    _, free = plan_of({"w1": P(None, "model"), "^batch/": P("data")})
    assert specs(free)["params/w2"] == P("model")
    # w2 pinned whole: it stays whole (the activation is gathered instead), and so does its update
    step, plan = plan_of({"w1": P(None, "model"), "w2": P(), "^batch/": P("data")})
    got = specs(plan)
    assert got["params/w2"] == P() and got["params/w1"] == P(None, "model")
    vids = dict(zip(plan.program.input_paths, plan.program.inputs, strict=True))
    assert {vids["params/w1"], vids["params/w2"], vids["batch/x"]} <= plan.state.frozen
    assert vids["params/b1"] not in plan.state.frozen
    new, loss = step(PARAMS, BATCH)
    ref_new, ref_loss = jax.jit(sgd_step)(PARAMS, BATCH)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(ref_new), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert new["w2"].sharding.spec == P()


def test_frozen_batch_spec_is_kept_by_later_tactics():
    # the batch pinned whole: data_parallel does not split it afterwards
    _, plan = plan_of({"^batch/": P()}, [tactics.data_parallel("data")])
    assert specs(plan)["batch/x"] == P() and specs(plan)["batch/y"] == P()


# ---------------------------------------------------------------------------- logical: flax axes

RULES = [("batch", "data"), ("embed", None), ("mlp", "model"), ("heads", "model"), ("layers", None)]


@pytest.mark.parametrize("names, rules", [
    (("embed", "mlp"), RULES),
    (("mlp", "embed"), RULES),
    (("mlp", "heads"), RULES),  # both want `model`: the first rule wins, the other dim stays whole
    (("heads", "mlp"), [("heads", "model"), ("mlp", "model")]),
    (("mlp", "heads"), [("mlp", "model"), ("heads", "model"), ("heads", "data")]),  # a fallback rule
    (("batch", None, "mlp"), [("batch", ("data", "model")), ("mlp", "model")]),  # tuple; mlp blocked
    (("batch", "mlp"), [("mlp", None), ("mlp", "model"), ("batch", "data")]),  # None claims the dim
    ((None, None), RULES),
    ((), RULES),
])
def test_logical_to_mesh_matches_flax(names, rules):
    from tactics.logical import to_mesh_spec

    assert to_mesh_spec(names, rules) == nn.logical_to_mesh_axes(names, rules)


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        zeros = nn.initializers.zeros_init()
        h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")),
                     bias_init=nn.with_logical_partitioning(zeros, ("mlp",)), name="up")(x)
        # `heads` loses `model` to `mlp` (the earlier rule): row-parallel, the heads come out whole
        h = nn.DenseGeneral((4, 8), kernel_init=nn.with_logical_partitioning(init, ("mlp", "heads", None)),
                            use_bias=False, name="proj")(jnp.tanh(h))
        out = nn.DenseGeneral(16, axis=(-2, -1), kernel_init=nn.with_logical_partitioning(init, (None, None, "embed")),
                              name="out")(h)  # bias unannotated: pinned whole, as flax says
        return out


class ScannedBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        init = nn.initializers.lecun_normal()
        h = nn.Dense(32, kernel_init=nn.with_logical_partitioning(init, ("embed", "mlp")), use_bias=False, name="up")(x)
        x = x + nn.Dense(16, kernel_init=nn.with_logical_partitioning(init, ("mlp", "embed")), use_bias=False,
                         name="down")(jnp.tanh(h))
        return x, None


class LinenScan(nn.Module):
    @nn.compact
    def __call__(self, x):
        blocks = nn.scan(ScannedBlock, variable_axes={"params": 0}, split_rngs={"params": True}, length=3,
                         metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = blocks(name="blocks")(x, None)
        return x


def _linen_workload(module):
    x = jnp.ones((8, 16))
    variables = jax.eval_shape(module.init, jax.random.key(0), x)
    params = nn.meta.unbox(variables)["params"]

    def loss_fn(params, batch):
        return jnp.mean((module.apply({"params": params}, batch["x"]) - batch["y"]) ** 2)

    optimizer = make_optimizer(1e-3)
    state = {"params": params, "opt_state": jax.eval_shape(optimizer.init, params)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32), "y": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    return variables, make_train_step(loss_fn, optimizer), state, batch


def _param_specs(plan, prefix="state/params/"):
    return {p[len(prefix):]: plan.state.partition_spec(v)
            for p, v in zip(plan.program.input_paths, plan.program.inputs, strict=True) if p.startswith(prefix)}


def _expected(logical_tree):
    mesh_tree = nn.logical_to_mesh(logical_tree, RULES)
    flat, _ = tree_util.tree_flatten_with_path(mesh_tree, is_leaf=lambda x: isinstance(x, P))
    return {"/".join(str(k.key) for k in path): _trim(spec) for path, spec in flat}


def _trim(spec):
    entries = list(spec)
    while entries and entries[-1] is None:
        entries.pop()
    return P(*entries)


@pytest.mark.parametrize("module", [LinenMLP(), LinenScan()], ids=["dense", "scan"])
@pytest.mark.parametrize("form", ["boxed", "get_partition_spec", "params"])
def test_logical_linen(module, form):
    variables, step, state, batch = _linen_workload(module)
    annotations = {
        "boxed": variables,  # LogicallyPartitioned boxes, {"params": ...} unwrapped
        "get_partition_spec": nn.get_partition_spec(variables),
        "params": nn.get_partition_spec(variables)["params"],
    }[form]
    tactic = tactics.logical(annotations, RULES)
    assert tactic.name == "logical"
    plan = automap.partition(step, mesh=MESH, tactics=[tactics.data_parallel("data"), tactic]).plan(state, batch)
    want = _expected(nn.get_partition_spec(variables)["params"])
    got = _param_specs(plan)
    assert got == want
    assert any(s != P() for s in want.values())
    if isinstance(module, LinenScan):
        assert want["blocks/up/kernel"] == P(None, None, "model")  # the layers dim stays whole
    # Adam's moments follow their parameters
    for moment in ("mu", "nu"):
        moments = _param_specs(plan, f"state/opt_state/1/0/{moment}/")
        assert moments == want


def test_logical_linen_numerics():
    module = LinenMLP()
    variables, step, _, _ = _linen_workload(module)
    params = nn.meta.unbox(module.init(jax.random.key(0), jnp.ones((8, 16))))["params"]
    state = init_state(params, make_optimizer(1e-3))
    batch = {"x": jnp.asarray(BATCH["x"]), "y": jnp.asarray(BATCH["y"])}
    f = automap.partition(step, mesh=MESH, tactics=[tactics.data_parallel("data"), tactics.logical(variables, RULES)])
    _, loss = f(state, batch)
    np.testing.assert_allclose(loss, jax.jit(step)(state, batch)[1], rtol=1e-5)


class NnxMLP(nnx.Module):
    def __init__(self, rngs):
        init = nnx.initializers.lecun_normal()
        self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                             bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)), rngs=rngs)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # `sharding=` is the older spelling
            self.down = nnx.Param(jnp.zeros((32, 16)), sharding=("mlp", "embed"))
        self.scale = nnx.Param(jnp.ones((16,)))  # unannotated: pinned whole

    def __call__(self, x):
        return (jnp.tanh(self.up(x)) @ self.down) * self.scale


def _nnx_workload():
    with nnx.use_eager_sharding(False):
        model = nnx.eval_shape(lambda: NnxMLP(nnx.Rngs(0)))
    graphdef, abstract = nnx.split(model)

    def loss_fn(params, batch):
        st = jax.tree.map(lambda x: x, abstract)
        nnx.replace_by_pure_dict(st, params)
        return jnp.mean((nnx.merge(graphdef, st)(batch["x"]) - batch["y"]) ** 2)

    optimizer = make_optimizer(1e-3)
    params = nnx.to_pure_dict(abstract)
    state = {"params": params, "opt_state": jax.eval_shape(optimizer.init, params)}
    batch = {"x": jax.ShapeDtypeStruct((8, 16), jnp.float32), "y": jax.ShapeDtypeStruct((8, 16), jnp.float32)}
    return model, abstract, make_train_step(loss_fn, optimizer), state, batch


@pytest.mark.parametrize("form", ["state", "get_partition_spec", "module"])
def test_logical_nnx(form):
    model, abstract, step, state, batch = _nnx_workload()
    annotations = {"state": abstract, "get_partition_spec": nnx.get_partition_spec(abstract), "module": model}[form]
    plan = automap.partition(step, mesh=MESH, tactics=[tactics.logical(annotations, RULES)]).plan(state, batch)
    want = {
        "up/kernel": P(None, "model"), "up/bias": P("model"), "down": P("model"), "scale": P(),
    }
    assert _param_specs(plan) == want
    # the same as flax's own resolution of the metadata under the rules
    with nn.logical_axis_rules(RULES):
        flax_specs = nnx.get_partition_spec(abstract)
    for path, spec in tree_util.tree_flatten_with_path(nnx.to_pure_dict(flax_specs), is_leaf=lambda x: isinstance(x, P))[0]:
        assert _trim(spec) == want["/".join(str(k.key) for k in path)]


def test_logical_rules_and_prefix():
    t = tactics.logical({"params": {"w": P("embed", "mlp")}}, RULES, prefix="state/params")
    assert t.rules == (("^state/params/w$", P(None, "model")),)
    t = tactics.logical({"w.x": P("mlp")}, RULES, prefix="")
    assert t.rules == ((r"^w\.x$", P("model")),)  # the path is escaped: an exact match
    assert tactics.logical({"w": P("mlp")}, [["mlp", ["data", "model"]]], prefix="p").rules[0][1] == P(("data", "model"))


@pytest.mark.parametrize("annotations, rules, exc, fragments", [
    ({"w": P("embed", "mpl")}, RULES, ValueError,
     ["logical axis name 'mpl'", "'state/params/w'", "no rule", "[('batch', 'data'), ('embed', None), ('mlp', 'model'),",
      "add ('mpl', <mesh axis or None>)"]),
    ({"w": P("mlp", "mlp")}, RULES, ValueError, ["names ['mlp'] more than once"]),
    ({"w": P("mlp")}, [("mlp", 3)], TypeError, ["('mlp', 3)", "mesh axis name, None or a tuple"]),
    ({"w": P("mlp")}, [("mlp",)], TypeError, ["(logical name, mesh axis or None or tuple) pair"]),
    ({}, RULES, ValueError, ["no annotated array leaves"]),
])
def test_logical_errors(annotations, rules, exc, fragments):
    with raises(exc, *fragments):
        tactics.logical(annotations, rules)


def test_logical_unknown_name_in_a_linen_model():
    variables, *_ = _linen_workload(LinenMLP())
    with raises(ValueError, "logical axis name 'heads'", "state/params/proj/kernel",
                "[('embed', None), ('mlp', 'model')]"):
        tactics.logical(variables, [("embed", None), ("mlp", "model")])


def test_logical_spec_the_mesh_cannot_take_is_a_sharding_error():
    variables, step, state, batch = _linen_workload(LinenMLP())
    f = automap.partition(step, mesh=MESH, tactics=[tactics.logical(variables, [*RULES[:2], ("mlp", "tensor"), *RULES[3:]])])
    with raises(ShardingError, "'tensor'", "is not a mesh axis", "manual rule '^state/params/"):
        f.plan(state, batch)
