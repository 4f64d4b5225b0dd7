"""Every input style plain ``jax.jit`` runs, automap runs too, with jax.jit's results: meshes with
Explicit/mixed axes, nnx.State + optax states, pure dicts, nnx objects, equinox modules, named remat
policies, shard_map / custom_partitioning / shard_alike inside the step. One row per style, each
planned with the default search and with ``search=None`` on data=2 x model=4."""
import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.experimental.shard_alike import shard_alike
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import automap
from automap import emit
from automap.rules import MissingRuleWarning

MESH = automap.make_mesh({"data": 2, "model": 4})
EXPLICIT = jax.make_mesh((2, 4), ("data", "model"))  # JAX's default: Explicit axes
MIXED = jax.make_mesh((2, 4), ("data", "model"), axis_types=(AxisType.Explicit, AxisType.Auto))
SEARCHES = ["auto", None]


def _x():
    return jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16) / 100


def _params():
    k1, k2 = jax.random.split(jax.random.PRNGKey(0))
    return {"w1": jax.random.normal(k1, (16, 32)) * 0.1, "w2": jax.random.normal(k2, (32, 8)) * 0.1}


def _loss(p, x):
    return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"]) ** 2)


def sgd_step(p, x):
    loss, g = jax.value_and_grad(_loss)(p, x)
    return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), loss


TX = optax.adam(1e-2)


def optax_step(p, opt_state, x):
    loss, g = jax.value_and_grad(_loss)(p, x)
    updates, opt_state = TX.update(g, opt_state, p)
    return optax.apply_updates(p, updates), opt_state, loss


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.l1 = nnx.Linear(16, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 8, rngs=rngs)

    def __call__(self, x):
        return self.l2(jax.nn.relu(self.l1(x)))


GRAPHDEF, _ = nnx.split(MLP(nnx.Rngs(0)))


def nnx_state_step(params, opt_state, x):  # flax's functional style: nnx.split, optax outside the model
    def loss_fn(params):
        return jnp.mean(nnx.merge(GRAPHDEF, params)(x) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def eqx_step(model, x):
    def loss_fn(model):
        return jnp.mean(jax.vmap(model)(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    return eqx.apply_updates(model, jax.tree_util.tree_map(lambda g: -0.1 * g, grads)), loss


def shard_map_step(p, x):
    def inner(xb, w1):
        return jnp.tanh(xb @ w1)

    h = jax.shard_map(inner, mesh=MESH, in_specs=(P("data", None), P(None, "model")), out_specs=P("data", "model"))(
        x, p["w1"]
    )
    return jnp.mean((h @ p["w2"]) ** 2)


def experimental_shard_map_step(p, x):  # the older entry point (deprecated, the same primitive)
    from jax.experimental.shard_map import shard_map

    h = shard_map(lambda xb: jnp.tanh(xb @ p["w1"]), mesh=MESH, in_specs=P("data", None), out_specs=P("data", None))(x)
    return jnp.mean((h @ p["w2"]) ** 2)


@custom_partitioning
def _matmul(a, b):
    return a @ b


def _cp_partition(mesh, arg_shapes, result_shape):  # rows stay as they come, the contraction whole
    rows = arg_shapes[0].sharding.spec[0] if arg_shapes[0].sharding.spec else None
    a, b, out = NamedSharding(mesh, P(rows, None)), NamedSharding(mesh, P()), NamedSharding(mesh, P(rows, None))
    return mesh, lambda a, b: a @ b, out, (a, b)


_matmul.def_partition(partition=_cp_partition, sharding_rule="i j, j k -> i k")


def custom_partitioning_step(p, x):
    return jnp.mean(jnp.tanh(_matmul(x, p["w1"])) @ p["w2"])


def shard_alike_step(p, x):
    h = jnp.tanh(x @ p["w1"])
    a, b = shard_alike(h, h * 2)
    return jnp.mean(a @ p["w2"]) + jnp.mean(b)


def _eqx_model():
    return eqx.nn.MLP(16, 8, 32, 1, activation=jax.nn.gelu, key=jax.random.PRNGKey(0))


def _nnx_state_args():
    _, params = nnx.split(MLP(nnx.Rngs(0)))
    return params, TX.init(params), _x()


# name -> (step, make args, mesh); the reference is jax.jit (eqx.filter_jit for equinox)
CASES = {
    "dict": (sgd_step, lambda: (_params(), _x()), MESH),
    "explicit_mesh": (sgd_step, lambda: (_params(), _x()), EXPLICIT),
    "mixed_axis_types": (sgd_step, lambda: (_params(), _x()), MIXED),
    "optax_state": (optax_step, lambda: (_params(), TX.init(_params()), _x()), MESH),
    "nnx_state_optax": (nnx_state_step, _nnx_state_args, MESH),
    "equinox": (eqx_step, lambda: (_eqx_model(), _x()), MESH),
    "shard_map": (shard_map_step, lambda: (_params(), _x()), MESH),
    "experimental_shard_map": (experimental_shard_map_step, lambda: (_params(), _x()), MESH),
    "custom_partitioning": (custom_partitioning_step, lambda: (_params(), _x()), MESH),
    "shard_alike": (shard_alike_step, lambda: (_params(), _x()), MESH),
}


def _snapshot(tree):
    return [np.array(leaf) for leaf in jax.tree_util.tree_leaves(tree) if eqx.is_array(leaf)]


def _assert_same(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)  # nothing returned twice
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        if eqx.is_array(w):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)
        else:
            assert g is w  # a static leaf (an equinox activation function) comes back as it was


@pytest.mark.parametrize("search", SEARCHES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_style_runs_and_equals_jit(case, search):
    step, make_args, mesh = CASES[case]
    args = make_args()
    before = _snapshot(args)
    want = (eqx.filter_jit if case == "equinox" else jax.jit)(step)(*make_args())
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingRuleWarning)
        f = automap.automap(step, mesh=mesh, search=search)
        got = f(*args)
    _assert_same(got, want)
    for b, a in zip(before, _snapshot(args), strict=True):  # arguments are never written into
        np.testing.assert_array_equal(a, b)
    if case.endswith("mesh") or case == "mixed_axis_types":  # outputs come back on the user's own mesh
        assert all(leaf.sharding.mesh == mesh for leaf in jax.tree_util.tree_leaves(got))
    if step in (sgd_step, optax_step, nnx_state_step):  # the state fed back: same plan, same numbers
        again = f(*got[:-1], args[-1])
        _assert_same(again, jax.jit(step)(*want[:-1], args[-1]))
        assert len(f._plans) == 1


def test_nnx_state_arguments_are_plain_pytrees():
    """nnx.State and optax states are returned, not written into; paths name the State's keys."""
    params, opt_state, x = _nnx_state_args()
    plan = automap.partition(nnx_state_step, mesh=MESH, search=None).plan(params, opt_state, x)
    assert "params/l1/kernel" in plan.traced.in_paths and "opt_state/0/mu/l1/kernel" in plan.traced.in_paths
    assert plan.traced.out_tree == jax.tree_util.tree_structure(jax.eval_shape(nnx_state_step, params, opt_state, x))


def test_nnx_objects_still_updated_in_place():
    def step(model, optimizer, x):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    def objects():
        model = MLP(nnx.Rngs(0))
        return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    ref_model, ref_opt = objects()
    want = nnx.jit(step)(ref_model, ref_opt, _x())
    model, opt = objects()
    got = automap.automap(step, mesh=MESH, search=None)(model, opt, _x())
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(model.l1.kernel[...], ref_model.l1.kernel[...], rtol=1e-5)
    assert int(opt.step[...]) == 1


def test_equinox_static_leaves_key_the_plan():
    f = automap.automap(eqx_step, mesh=MESH, search=None)
    f(_eqx_model(), _x())
    f(_eqx_model(), _x())
    assert len(f._plans) == 1  # the same activation function: the same plan
    other = eqx.nn.MLP(16, 8, 32, 1, activation=jax.nn.relu, key=jax.random.PRNGKey(0))
    _assert_same(f(other, _x()), eqx.filter_jit(eqx_step)(other, _x()))
    assert len(f._plans) == 2


class _Holder(eqx.Module):
    opts: object
    w: jax.Array


def test_unhashable_static_leaf_is_named():
    holder = _Holder(_Unhashable(), jnp.ones(2))
    with pytest.raises(TypeError, match=r"argument leaf 'p\.opts' is _Unhashable .*hashable"):
        automap.automap(lambda p, x: x * 2, mesh=MESH, search=None)(holder, _x())


class _Unhashable:
    __hash__ = None


POLICIES = {
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    "save_only_these_names": jax.checkpoint_policies.save_only_these_names("h"),
    "save_any_names_but_these": jax.checkpoint_policies.save_any_names_but_these("h"),
    "save_anything_except_these_names": jax.checkpoint_policies.save_anything_except_these_names("h"),
    "save_from_both_policies": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_saveable, jax.checkpoint_policies.save_only_these_names("h")
    ),
    "save_and_offload_only_these_names": jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["h"], offload_src="device",
        offload_dst="pinned_host",
    ),
}


def _named_remat_step(policy):
    def loss(p, x):
        h = checkpoint_name(jnp.tanh(x @ p["w1"]), "h")
        return jnp.mean((h @ p["w2"]) ** 2)

    def step(p, x):
        return jax.value_and_grad(jax.checkpoint(loss, policy=policy))(p, x)

    return step


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_checkpoint_policy(name):
    step = _named_remat_step(POLICIES[name])
    try:
        want = jax.jit(step)(_params(), _x())
    except Exception as e:  # pragma: no cover - host offload is not on every backend
        pytest.skip(f"jax.jit cannot run {name} here: {e}")
    f = automap.automap(step, mesh=MESH, search=None)
    _assert_same(f(_params(), _x()), want)
    plan = f.plan(_params(), _x())  # the name survives emission: a named policy still sees it
    replayed = jax.make_jaxpr(emit.replay_fn(plan.state, MESH, plan.pins))(*jax.tree_util.tree_leaves((_params(), _x())))
    assert "name=h" in str(replayed)


@pytest.mark.parametrize("search", SEARCHES)
def test_shard_map_keeps_the_users_in_specs(search):
    p, x = _params(), _x()
    f = automap.automap(shard_map_step, mesh=MESH, search=search)
    plan = f.plan(p, x)
    assert plan.in_shardings[0]["w1"].spec == P(None, "model")
    assert plan.in_shardings[1].spec == P("data")
    compiled = f.lower(p, x).compile()
    (w1_in, _, x_in), _ = compiled.input_shardings  # flat: p/w1, p/w2, x
    assert w1_in.is_equivalent_to(NamedSharding(MESH, P(None, "model")), 2)
    assert x_in.is_equivalent_to(NamedSharding(MESH, P("data", None)), 2)


def test_shard_map_on_another_mesh_is_named():
    other = automap.make_mesh({"rows": 2, "cols": 4})

    def step(x):
        return jax.shard_map(lambda a: a * 2, mesh=other, in_specs=P("rows"), out_specs=P("rows"))(x)

    with pytest.raises(ValueError, match=r"shard_map at .* mesh axes \['rows'\].*same mesh"):
        automap.automap(step, mesh=MESH, search=None).plan(_x())


def test_under_a_callers_explicit_mesh_context():
    """``with jax.set_mesh(explicit):`` around the call: traced and run on the Auto view."""
    with jax.set_mesh(EXPLICIT):
        want = jax.jit(sgd_step)(_params(), _x())
        f = automap.automap(sgd_step, mesh=EXPLICIT, search=None)
        got = f(_params(), _x())
        again = f(got[0], _x())  # outputs (on the Explicit mesh) fed back in
    _assert_same(got, want)
    _assert_same(again, jax.jit(sgd_step)(want[0], _x()))
