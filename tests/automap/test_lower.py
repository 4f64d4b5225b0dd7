"""automap.ir.lower: calls inlined, control flow kept as regions, module paths and phases, selects
of one value folded."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import automap
from automap.ir.lower import lower, module_path, phase_of
from automap.trace import trace

F32 = jnp.float32
CALLS = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
         "custom_vjp_call_jaxpr", "remat2", "checkpoint", "name"}


def sds(*shape, dtype=F32):
    return jax.ShapeDtypeStruct(shape, dtype)


def program(fn, *args, **kw):
    t = trace(fn, args)
    return lower(t.closed_jaxpr, t.in_paths, t.out_paths, **kw)


@jax.custom_vjp
def _sin(x):
    return jnp.sin(x)


_sin.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))


def _calls(x, w):
    h = jax.jit(lambda a: a @ w)(x)
    h = jax.nn.relu(h)  # custom_jvp
    h = jax.checkpoint(lambda a: jnp.tanh(a) * 2)(h)
    return _sin(h).sum()


# ---------------------------------------------------------------------------- inlining

@pytest.mark.parametrize("fn", [_calls, jax.value_and_grad(_calls)], ids=["forward", "value_and_grad"])
def test_calls_are_inlined(fn):
    p = program(fn, sds(8, 4), sds(4, 4))
    prims = p.primitives()
    assert not prims & CALLS, prims & CALLS
    assert {"dot_general", "max", "tanh", "sin"} <= prims
    # values are unique across the program and every op refers to defined values
    assert [v.id for v in p.values] == list(range(len(p.values)))
    for op in p.all_ops:
        assert all(0 <= v < len(p.values) for v in op.inputs + op.outputs)


def test_remat_is_recorded():
    def fn(x, w):
        return jax.checkpoint(lambda a: jnp.tanh(a @ w) * 2)(x).sum()

    p = program(fn, sds(8, 4), sds(4, 4))
    assert not p.primitives() & CALLS
    assert len(p.remat_calls) == 1
    (call,) = p.remat_calls.values()
    assert sorted(p.value(v).shape for v in call.inputs) == [(4, 4), (8, 4)]
    assert [p.value(v).shape for v in call.outputs] == [(8, 4)]
    inside = [op.primitive for op in p.all_ops if op.remat == (call.id,)]
    assert inside == ["dot_general", "tanh", "mul"]
    assert [op.primitive for op in p.all_ops if not op.remat] == ["reduce_sum"]


def test_remat_under_grad_is_recorded_in_the_backward():
    def fn(x, w):
        return jax.checkpoint(lambda a: jnp.tanh(a @ w))(x).sum()

    p = program(jax.grad(fn, argnums=1), sds(8, 4), sds(4, 4))
    assert len(p.remat_calls) >= 1
    remat_ops = [op for op in p.all_ops if op.remat]
    assert remat_ops and {op.phase for op in remat_ops} == {"backward"}


# ---------------------------------------------------------------------------- regions

def _scan_model(ws, x):
    def body(h, w):
        return jnp.tanh(h @ w), h.sum(1)

    h, sums = jax.lax.scan(body, x, ws)
    return h.sum() + sums.sum()


def test_scan_is_one_op_with_one_region():
    p = program(_scan_model, sds(5, 4, 4), sds(8, 4))
    scans = [op for op in p.ops if op.primitive == "scan"]
    assert len(scans) == 1
    (scan,) = scans
    (region,) = scan.regions
    assert region.trips == 5 == scan.params["length"]
    assert region.role == "body"
    assert [op.primitive for op in region.ops] == ["dot_general", "tanh", "reduce_sum"]
    # the body sees one layer of the stacked weights, and the carry
    assert [p.value(v).shape for v in region.inputs] == [(8, 4), (4, 4)]
    assert [p.value(v).kind for v in region.inputs] == ["region_input"] * 2
    assert [p.value(v).name for v in region.inputs] == ["carry", "x"]
    # outer results: the carry and the stacked per-layer sums
    assert [p.value(v).shape for v in scan.outputs] == [(8, 4), (5, 8)]
    # the multiplier of body ops is the trip count
    assert {m for op, m in p.walk() if op in region.ops} == {5}


@pytest.mark.parametrize("grad", [False, True])
def test_scan_body_is_depth_independent(grad):
    fn = jax.grad(_scan_model) if grad else _scan_model

    def region_sizes(layers):
        p = program(fn, sds(layers, 4, 4), sds(8, 4))
        return [(len(r.ops), r.trips) for op in p.all_ops for r in op.regions], len(p.all_ops)

    (two, n2), (six, n6) = region_sizes(2), region_sizes(6)
    assert [n for n, _ in two] == [n for n, _ in six]
    assert [t for _, t in two] == [2] * len(two) and [t for _, t in six] == [6] * len(six)
    assert n2 == n6
    assert len(two) == (2 if grad else 1)  # forward scan, plus the transposed scan of the backward


def test_cond_and_while_regions():
    def fn(x, n):
        y = jax.lax.cond(n > 0, lambda a: a * 2, lambda a: a - 1, x)
        i, z = jax.lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.sin(c[1])), (0, y))
        return z

    p = program(fn, sds(8, 4), sds(dtype=jnp.int32))
    cond = next(op for op in p.ops if op.primitive == "cond")
    assert [(r.role, r.trips, [o.primitive for o in r.ops]) for r in cond.regions] == [
        ("branch", 1, ["sub"]), ("branch", 1, ["mul"])]
    assert all([p.value(v).shape for v in r.inputs] == [(8, 4)] for r in cond.regions)
    loop = next(op for op in p.ops if op.primitive == "while")
    (c, body) = loop.regions
    assert (c.role, body.role) == ("cond", "body")
    assert "lt" in [o.primitive for o in c.ops]
    assert sorted(o.primitive for o in body.ops) == ["add", "sin"]
    assert [p.value(v).shape for v in loop.outputs] == [(), (8, 4)]
    # region values belong to their region, top-level values to region 0
    for r in cond.regions + loop.regions:
        assert {p.value(v).region for v in r.inputs} == {r.id}
    assert {p.value(v).region for v in p.inputs} == {0}


# ---------------------------------------------------------------------------- names and phases

@pytest.mark.parametrize("stack, path, phase", [
    ("", "", None),
    ("GPT/blocks_0/attn", "GPT/blocks_0/attn", None),
    ("jvp(GPT)/blocks_0", "GPT/blocks_0", "forward"),
    ("transpose(jvp(GPT/blocks_0))/attn", "GPT/blocks_0/attn", "backward"),
    ("checkpoint/rematted_computation/mlp", "checkpoint/mlp", None),
])
def test_module_path_and_phase_of(stack, path, phase):
    assert module_path(stack) == path
    assert phase_of(stack) == phase


def test_named_scope_gives_op_names():
    def fn(x, w):
        with jax.named_scope("encoder"):
            with jax.named_scope("proj"):
                h = x @ w
            h = jnp.tanh(h)
        return h.sum()

    p = program(fn, sds(8, 4), sds(4, 4))
    names = {op.primitive: op.name for op in p.all_ops}
    assert names == {"dot_general": "encoder/proj", "tanh": "encoder", "reduce_sum": ""}
    # intermediates are named after their module path and primitive
    assert p.value(p.ops[0].outputs[0]).name == "encoder/proj/dot_general"


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(16, name="fc")(x))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(1, name="head")(_Block(name="encoder")(x))


def _flax_step():
    net, opt = _Net(), optax.adam(1e-3)
    params = jax.eval_shape(net.init, jax.random.key(0), sds(8, 4))
    opt_state = jax.eval_shape(opt.init, params)

    def step(params, opt_state, x, y):
        loss, g = jax.value_and_grad(lambda p: ((net.apply(p, x) - y) ** 2).mean())(params)
        updates, opt_state = opt.update(g, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step, (params, opt_state, sds(8, 4), sds(8, 1))


def test_flax_module_paths_and_phases():
    step, args = _flax_step()
    p = program(step, *args)
    dots = [(op.name, op.phase, p.value(op.outputs[0]).shape) for op in p.all_ops if op.primitive == "dot_general"]
    assert dots[:2] == [("_Net/encoder/fc", "forward", (8, 16)), ("_Net/head", "forward", (8, 1))]
    # backward, head first: the head's kernel and input gradients, the encoder's kernel gradient
    # (x is not differentiated)
    assert [(n, ph) for n, ph, _ in dots[2:]] == [("_Net/head", "backward")] * 2 + [("_Net/encoder/fc", "backward")]
    phases = [op.phase for op in p.ops]
    # forward, then backward, then the optimizer, each a contiguous run
    assert phases == sorted(phases, key=["forward", "backward", "optimizer"].index)
    assert set(phases) == {"forward", "backward", "optimizer"}
    assert any("optax" in op.source for op in p.ops if op.phase == "optimizer")
    assert all(p.value(v).phase == "input" for v in p.inputs)


def test_values_have_shapes_dtypes_and_paths():
    def fn(params, x):
        h = (x.astype(jnp.bfloat16) @ params["w"]).astype(F32)
        return h.sum(), jnp.argmax(h, axis=1)

    p = program(fn, {"w": sds(4, 6, dtype=jnp.bfloat16)}, sds(8, 4))
    assert p.input_paths == ("params/w", "x")
    assert [(p.value(v).shape, p.value(v).dtype, p.value(v).kind) for v in p.inputs] == [
        ((4, 6), jnp.bfloat16, "input"), ((8, 4), F32, "input")]
    assert [(p.value(v).shape, p.value(v).dtype) for v in p.outputs] == [((), F32), ((8,), jnp.int32)]
    assert p.output_paths == ("out/0", "out/1")
    dot = next(op for op in p.ops if op.primitive == "dot_general")
    out = p.value(dot.outputs[0])
    assert (out.shape, out.dtype, out.itemsize, out.nbytes) == ((8, 6), jnp.bfloat16, 2, 96)
    assert "test_lower.py" in dot.source


def test_literals_and_consts_are_values():
    table = np.arange(6, dtype=np.float32)

    def fn(x):
        return x * 3.0 + jnp.asarray(table)

    p = program(fn, sds(6))
    mul, add = p.ops
    lit = p.value(mul.inputs[1])
    assert (lit.kind, lit.shape, float(np.asarray(lit.literal))) == ("literal", (), 3.0)
    const = next(p.value(v) for v in add.inputs if p.value(v).kind == "const")
    assert const.name == "const"
    np.testing.assert_array_equal(np.asarray(const.literal), table)


def _selects(p, x, order):
    same = jnp.where(p, x, x)  # one value twice
    zeros = jnp.where(p, jnp.zeros_like(x), jnp.zeros_like(x))  # splats of one scalar
    other = jnp.where(p, jnp.zeros_like(x), jnp.ones_like(x))  # splats of two scalars: kept
    put = jax.jvp(lambda y: jnp.zeros_like(y).at[order].set(y), (x,), (x,))[1]
    return same + zeros + other + put


def test_a_select_of_one_value_is_that_value_and_replays_as_the_function():
    args = (np.arange(32) % 3 == 0, np.random.RandomState(0).randn(32).astype(np.float32), np.arange(32)[::-1])
    prog = program(_selects, *args)
    # left: the kept select, the index's wrap-around (order < 0) and the tangent's updates mask
    assert [op.primitive for op in prog.ops].count("select_n") == 3
    f = automap.partition(_selects, mesh=automap.make_mesh({"data": 2, "model": 4}), pins="all")
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(_selects(*args)))
