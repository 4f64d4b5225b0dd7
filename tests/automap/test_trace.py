"""automap.trace: pytree paths of inputs and outputs, abstract tracing, fed-back outputs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from automap.trace import abstractify, feedback_pairs, trace

F32 = jnp.float32


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


# ---------------------------------------------------------------------------- paths

def _dict_and_tuple(params, batch):
    return (batch[0] @ params["w"]).sum()


def _nested(params, batch, xs):
    return {"loss": (batch["x"] @ params["enc"]["w"]).sum(), "aux": [xs[0], (xs[1],)]}


def _single(a):
    return a * 2


def _tuple_out(a):
    return (a,)


def _list_out(a):
    return [a, a + 1]


def _varargs(x, *rest):
    return x + rest[0]


@pytest.mark.parametrize("fn, args, in_paths, out_paths", [
    (_dict_and_tuple, ({"w": sds(4, 2)}, (sds(8, 4), sds(3))), ("params/w", "batch/0", "batch/1"), ("out",)),
    (_nested,
     ({"enc": {"w": sds(4, 2), "b": sds(2)}}, {"x": sds(8, 4)}, [sds(1), sds(2)]),
     ("params/enc/b", "params/enc/w", "batch/x", "xs/0", "xs/1"),
     ("out/aux/0", "out/aux/1/0", "out/loss")),
    (_single, (sds(3),), ("a",), ("out",)),
    (_tuple_out, (sds(3),), ("a",), ("out/0",)),
    (_list_out, (sds(3),), ("a",), ("out/0", "out/1")),
    (_varargs, (sds(3), sds(3)), ("x", "arg1"), ("out",)),
    (lambda state, batch: (state, batch["x"].sum()),
     ({"params": {"w": sds(2)}, "step": sds(dtype=jnp.int32)}, {"x": sds(4)}),
     ("state/params/w", "state/step", "batch/x"), ("out/0/params/w", "out/0/step", "out/1")),
])
def test_paths(fn, args, in_paths, out_paths):
    t = trace(fn, args)
    assert t.in_paths == in_paths
    assert t.out_paths == out_paths
    assert len(t.in_avals) == len(in_paths) and len(t.out_avals) == len(out_paths)


def test_static_args_are_excluded_and_names_come_from_the_signature():
    def step(params, n_layers, batch, scale):
        return (batch @ params["w"]).sum() * n_layers * scale

    t = trace(step, ({"w": sds(4, 2)}, 3, sds(8, 4), 0.5), static_argnums=(1, 3))
    assert t.arg_names == ("params", "batch")
    assert t.in_paths == ("params/w", "batch")
    assert t.leaf_arg == (0, 1)
    assert [a.shape for a in t.in_avals] == [(4, 2), (8, 4)]
    # the static values were baked in: 3 * 0.5 appears as a multiplication by a literal
    assert len(t.closed_jaxpr.jaxpr.invars) == 2


def test_avals_shapes_and_dtypes():
    t = trace(lambda x, i: (x.astype(jnp.bfloat16), i + 1), (sds(8, 4), sds(3, dtype=jnp.int32)))
    assert [(a.shape, a.dtype) for a in t.in_avals] == [((8, 4), F32), ((3,), jnp.int32)]
    assert [(a.shape, a.dtype) for a in t.out_avals] == [((8, 4), jnp.bfloat16), ((3,), jnp.int32)]


def test_abstractify_arrays_numpy_and_scalars():
    assert abstractify(np.zeros((2, 3), np.int8)) == jax.ShapeDtypeStruct((2, 3), np.int8)
    assert abstractify(jnp.ones(4)) == jax.ShapeDtypeStruct((4,), F32)
    assert abstractify(2.0).shape == ()
    s = sds(5)
    assert abstractify(s) is s


# ---------------------------------------------------------------------------- nothing allocated

def test_huge_shape_dtype_struct_allocates_nothing():
    big = sds(2**20, 2**20)  # 4 TiB: any allocation would fail
    t = trace(lambda w, x: jnp.tanh(x @ w).sum(0), (big, sds(16, 2**20)))
    assert t.in_avals[0].shape == (2**20, 2**20)
    assert t.out_avals[0].shape == (2**20,)


def test_huge_shape_dtype_struct_plans_without_allocating():
    import automap

    mesh = automap.make_mesh({"data": 2, "model": 4})
    big = sds(2**20, 2**20)
    plan = automap.partition(lambda x: (x * 2).sum(1), mesh=mesh, search=None).plan(big)
    assert plan.state.spec(plan.program.inputs[0]) == (("data", "model"), ())
    assert plan.state.bytes_per_device(plan.program.inputs[0]) == 2**40 * 4 // 8


# ---------------------------------------------------------------------------- fed-back outputs

def test_feedback_pairs_train_step():
    def step(state, batch):
        g = jax.grad(lambda p: ((batch["x"] @ p["w"] + p["b"]) ** 2).sum())(state["params"])
        params = jax.tree.map(lambda a, b: a - 0.1 * b, state["params"], g)
        return {"params": params, "step": state["step"] + 1}, batch["x"].sum()

    state = {"params": {"w": sds(4, 2), "b": sds(2)}, "step": sds(dtype=jnp.int32)}
    t = trace(step, (state, {"x": sds(8, 4)}))
    assert t.in_paths == ("state/params/b", "state/params/w", "state/step", "batch/x")
    assert t.out_paths == ("out/0/params/b", "out/0/params/w", "out/0/step", "out/1")
    # every state leaf feeds back to itself; the batch and the loss do not
    assert feedback_pairs(t) == {0: 0, 1: 1, 2: 2}


@pytest.mark.parametrize("fn, args, pairs", [
    # whole output is the updated state (tuple / list / dict)
    (lambda s: (s[0] * 2, s[1] + 1), ((sds(3), sds(2)),), {0: 0, 1: 1}),
    (lambda s: [s[0] * 2, s[1] + 1], ([sds(3), sds(2)],), {0: 0, 1: 1}),
    (lambda s: {"a": s["a"] * 2}, ({"a": sds(3)},), {0: 0}),
    # (loss, state): the position in the output tuple does not matter
    (lambda s, b: (b.sum(), {"w": s["w"] + 1}), ({"w": sds(3)}, sds(4)), {1: 0}),
    # a changed shape or dtype is not the state coming back
    (lambda s, b: ({"w": s["w"][:2]}, b.sum()), ({"w": sds(3)}, sds(4)), {}),
    (lambda s, b: ({"w": s["w"].astype(jnp.int32)}, b.sum()), ({"w": sds(3)}, sds(4)), {}),
    # a different structure is not the state
    (lambda s, b: ({"v": s["w"]}, b.sum()), ({"w": sds(3)}, sds(4)), {}),
])
def test_feedback_pairs_cases(fn, args, pairs):
    assert feedback_pairs(trace(fn, args)) == pairs
