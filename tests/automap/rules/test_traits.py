"""Primitive records: every registered rule has declared traits, contractions describe what they
contract, the default for a primitive without traits is the conservative one, and a new
contraction-like primitive is one entry from which FLOPs, materialization, emission pinning and
megatron's matmul pairing all follow."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir

import automap
import tactics
from automap.cost.flops import dot_flops, fusible, op_flops
from automap.cost.memory import materialized
from automap.emit import pinned_values
from automap.shardings import ShardingState
from automap.rules import (
    RULES, TRAITS, RuleContext, Shaped, Traits, contraction, einsum, record, register, traits_of, undeclared,
)
from automap.rules.traits import UNKNOWN, input_elements, no_flops, output_elements


@pytest.fixture
def tables():
    """Rules and traits registered by a test are removed after it."""
    saved = dict(RULES), dict(TRAITS)
    yield
    for table, old in zip((RULES, TRAITS), saved):
        table.clear()
        table.update(old)


def test_every_rule_has_declared_traits():
    missing = undeclared()
    assert not missing, (
        f"primitives with a factor rule but no traits: {missing}. Pass traits= to their register(...) "
        "(a family constant of automap.rules.traits, or contraction(...)), or register them with a family helper."
    )


def test_records_join_rule_and_traits():
    r = record("dot_general")
    assert r.rule is RULES["dot_general"] and r.traits is TRAITS["dot_general"] and r.declared
    scan = record("scan")
    assert scan.rule is None and scan.declared and scan.traits.materializing
    assert record("automap_no_such_primitive") == record("automap_no_such_primitive")
    assert not record("automap_no_such_primitive").declared


def _ctx(operands, results):
    return RuleContext("t", tuple(Shaped(s, jnp.float32) for s in operands),
                       tuple(Shaped(s, jnp.float32) for s in results))


# (primitive, operand shapes, result shapes, params, contracted dims of each operand, FLOPs)
CONTRACTION_ROWS = [
    ("dot_general", [(4, 8), (8, 2)], [(4, 2)], dict(dimension_numbers=(((1,), (0,)), ((), ()))),
     ((1,), (0,)), 2 * 4 * 2 * 8),
    ("dot_general", [(3, 4, 8), (3, 2, 8)], [(3, 4, 2)], dict(dimension_numbers=(((2,), (2,)), ((0,), (0,)))),
     ((2,), (2,)), 2 * 3 * 4 * 2 * 8),
    ("conv_general_dilated", [(2, 3, 8, 8), (4, 3, 3, 3)], [(2, 4, 8, 8)],
     dict(dimension_numbers=jax.lax.ConvDimensionNumbers((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 3)),
          feature_group_count=1, batch_group_count=1),
     ((1, 2, 3), (1, 2, 3)), 2 * (2 * 4 * 8 * 8) * (3 * 3 * 3)),  # OIHW: kernel elements / its 4 outputs
]


@pytest.mark.parametrize("primitive, ins, outs, params, dims, flops", CONTRACTION_ROWS,
                         ids=["matmul", "batched", "conv"])
def test_contraction_records(primitive, ins, outs, params, dims, flops):
    t = traits_of(primitive)
    ctx = _ctx(ins, outs)
    assert t.contraction is not None and t.contraction.dims(ctx, **params) == dims
    assert t.flops(ctx, **params) == flops
    # the rule's reduction factors sit on contracted dims (a conv's windows are summed too, but stay whole)
    rule = RULES[primitive](ctx, **params)
    reduced = set(rule.reduction_factors)
    for operand, contracted in zip(rule.operands, dims, strict=True):
        assert {d for d, fs in enumerate(operand) if set(fs) & reduced} <= set(contracted)


def test_every_contraction_is_a_pinned_kernel_with_its_own_flops():
    generic = {no_flops, input_elements, output_elements}
    contractions = {p: t for p, t in TRAITS.items() if t.contraction is not None}
    assert {"dot_general", "conv_general_dilated"} <= set(contractions)
    for p, t in contractions.items():
        assert t.flops not in generic, p
        assert (t.fusion, t.memory, t.emit) == ("kernel", "kernel", "pin"), p
    # conv: no matmul for the tactics; the dot-like contractions are
    assert {p for p, t in contractions.items() if t.matmul} == {"dot_general", "ragged_dot_general", "scaled_dot",
                                                                 "scaled_matmul_wrapper"}


@pytest.mark.parametrize("field, value", [("fusion", "fused"), ("memory", "kernels"), ("emit", "pinned")])
def test_traits_reject_unknown_modes(field, value):
    kw = dict(flops=no_flops, fusion="loop", memory="fused")
    kw[field] = value
    with pytest.raises(ValueError, match=f"Traits.{field}='{value}' is not one of"):
        Traits(**kw)


# ---------------------------------------------------------------------------------------------
# the default, and a new contraction as one entry

def _primitive(name, impl, abstract):
    p = Primitive(name)
    p.def_impl(impl)
    p.def_abstract_eval(abstract)
    mlir.register_lowering(p, mlir.lower_fun(impl, multiple_results=False))
    return p


opaque_p = _primitive("automap_test_opaque", lambda x: x * 3, lambda x: x)
toy_matmul_p = _primitive(
    "automap_test_matmul", lambda x, w: jnp.dot(x, w),
    lambda x, w: jax.core.ShapedArray((x.shape[0], w.shape[1]), x.dtype),
)


def _lower(fn, *args):
    t = automap.trace(fn, args)
    return automap.lower(t.closed_jaxpr, t.in_paths, t.out_paths)


def test_a_primitive_without_traits_gets_the_conservative_default(tables):
    register(opaque_p)(lambda ctx, **_: einsum(ctx, "ab->ab"))  # a rule, no traits (like a derived rule)
    assert undeclared() == ["automap_test_opaque"] and traits_of(opaque_p) is UNKNOWN
    prog = _lower(lambda x: jnp.sin(opaque_p.bind(x)), jnp.ones((4, 8)))
    op = next(op for op in prog.ops if op.primitive == "automap_test_opaque")
    assert op_flops(prog, op) == 32 and dot_flops(prog, op) == 0 and not fusible(prog, op)
    assert set(op.inputs + op.outputs) <= materialized(prog.ops, prog.outputs)
    assert not set(op.outputs) & pinned_values(ShardingState.initial(prog, {"data": 2}))


def _mlp_step(matmul):
    def step(params, x):
        y = matmul(jnp.tanh(matmul(x, params["up"])), params["down"])
        return {k: v * 0.5 for k, v in params.items()}, (y * y).sum()
    return step


def test_a_new_contraction_is_one_entry(tables):
    @register(toy_matmul_p, traits=contraction(lambda ctx, **_: ((1,), (0,))))
    def _rule(ctx, **_):
        return einsum(ctx, "mk,kn->mn")

    mesh = automap.make_mesh({"data": 2, "model": 4})
    up, down = (jax.random.normal(jax.random.key(i), shape) for i, shape in enumerate([(8, 16), (16, 8)]))
    params = {"up": up, "down": down}
    x = jax.random.normal(jax.random.key(2), (4, 8))
    tp = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))
    toy, dot = (automap.partition(_mlp_step(m), mesh=mesh, tactics=[tp], search=None)
                for m in (toy_matmul_p.bind, jnp.dot))
    plan, want = toy.plan(params, x), dot.plan(params, x)
    assert "dot_general" not in plan.program.primitives()
    # FLOPs, memory, megatron's column/row pairing and emission's pins: all as for dot_general
    ops = [op for op in plan.program.all_ops if op.primitive == toy_matmul_p.name]
    assert [op_flops(plan.program, op) for op in ops] == [2 * 4 * 16 * 8, 2 * 4 * 8 * 16]
    assert [dot_flops(plan.program, op) for op in ops] == [2 * 4 * 16 * 8, 2 * 4 * 8 * 16]
    assert (plan.estimate.flops, plan.estimate.dot_flops) == (want.estimate.flops, want.estimate.dot_flops)
    assert plan.estimate.memory == want.estimate.memory
    assert [plan.state.spec(v) for v in plan.program.inputs] == [want.state.spec(v) for v in want.program.inputs]
    assert plan.state.spec(plan.program.inputs[1]) == ((), ("model",))  # up: column-parallel
    assert any("column" in n and "paired with row" in n for n in plan.notes)
    pins = pinned_values(plan.state, "anchors")  # the policy that reads the traits' emit="pin"
    assert all(set(op.outputs) <= pins for op in ops)
    assert len(pins) == len(pinned_values(want.state, "anchors"))
    got, ref = toy(params, x), jax.jit(_mlp_step(jnp.dot))(params, x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))


RAGGED = dict(m=12, k=8, n=4, g=3)


def _ragged_loss(x, w, sizes):
    return jax.lax.ragged_dot(x, w, sizes).sum()


def _ragged_args():
    m, k, n, g = (RAGGED[c] for c in "mkng")
    return jnp.ones((m, k)), jnp.ones((g, k, n)), jnp.array([4, 4, 4], jnp.int32)


@pytest.mark.parametrize("platform, groups", [(None, 1), ("tpu", 1), ("cpu", RAGGED["g"]), ("gpu", RAGGED["g"])])
def test_ragged_dot_flops_are_what_the_platform_compiles(platform, groups):
    """Each row against one group's weights (its arithmetic, TPU's ragged dot); XLA:CPU and
    XLA:GPU run a dense dot over every group, ``g`` times that."""
    from automap.ir.lower import lower

    m, k, n = RAGGED["m"], RAGGED["k"], RAGGED["n"]
    grad = jax.make_jaxpr(jax.value_and_grad(_ragged_loss, argnums=(0, 1)))(*_ragged_args())
    prog = lower(grad, ["x", "w", "sizes"], ["loss", "dx", "dw"])
    ragged = [op for op in prog.all_ops if op.primitive == "ragged_dot_general"]
    flops = [op_flops(prog, op, platform) for op in ragged]
    assert flops == [dot_flops(prog, op, platform) for op in ragged]
    assert flops == [2 * m * k * n * groups] * 3  # forward, input gradient, weight gradient


def test_ragged_dot_flops_estimated_on_cpu_equal_xlas():
    """The estimate of a ragged dot's forward and backward, its weights split over 'model',
    counts the dot FLOPs XLA:CPU compiles (the weight gradient, a contraction over the blocked
    rows, included)."""
    from jax.sharding import PartitionSpec as P

    mesh = automap.make_mesh({"data": 2, "model": 4})
    fn = jax.value_and_grad(_ragged_loss, argnums=(0, 1))
    step = automap.automap(fn, mesh=mesh, search=None, tactics=[tactics.manual([("^w$", P(None, None, "model"))])])
    args = _ragged_args()
    plan = step.plan(*args)
    measured = automap.measure(step.lower(*args).compile())
    m, k, n, g = (RAGGED[c] for c in "mkng")
    assert plan.estimate.dot_flops == measured.dot_flops == 3 * 2 * m * k * g * n // 4
