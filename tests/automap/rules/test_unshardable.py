"""Primitives kept whole on purpose (host callbacks, ...) and rules checked on a RuleContext
where the primitive cannot be run through the harness (private to JAX, explicit meshes)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import automap
from automap.rules import RULES, UNSHARDABLE, RuleContext, Shaped
from harness import check, row

S = (16, 32)
DM = P("data", "model")


def host_sin(x):
    return jax.pure_callback(np.sin, jax.ShapeDtypeStruct(x.shape, x.dtype), x) * 2


ROWS = [
    # a host callback receives whole arrays: its operand is gathered (XLA runs it on one device
    # and all-reduces its result to the others)
    row("pure_callback", host_sin, [S], {"x": DM}, P(), {"all-gather", "all-reduce"}, inner={"pure_callback": P()},
        model={"all-gather"}),
]


@pytest.mark.parametrize("r", ROWS)
def test_unshardable(r):
    res = check(r)
    (op,) = [op for op in res.plan.program.all_ops if op.primitive == "pure_callback"]
    assert op.has_rule and all(f.kind == "blocked" for f in op.rule.factors)


def test_report_says_which_op_stayed_whole_and_why():
    step = automap.partition(host_sin, mesh=automap.make_mesh({"data": 2, "model": 4}), strict=True)
    report = step.plan(jnp.ones(S)).report()
    assert f"kept whole: pure_callback at {__file__}" in report
    assert UNSHARDABLE["pure_callback"] in report


def ctx(primitive, ins, outs, dtype=jnp.float32):
    return RuleContext(primitive, tuple(Shaped(s, dtype) for s in ins), tuple(Shaped(s, dtype) for s in outs))


def kinds(rule):
    return "".join(f.kind[0] for f in rule.factors)


RULE_ROWS = [
    # primitive, operand shapes, result shapes, params, factor kinds, operand dims, result dims
    ("mulhi", [S, S], [S], {}, "pp", (((0,), (1,)), ((0,), (1,))), (((0,), (1,)),)),
    ("reshard", [S], [S], {"dst_sharding": None}, "pp", (((0,), (1,)),), (((0,), (1,)),)),
    # the generic select_and_scatter (operand, source, init): unwindowed dims shared
    ("select_and_scatter", [(8, 16, 16, 4), (8, 8, 8, 4), ()], [(8, 16, 16, 4)],
     {"window_dimensions": (1, 2, 2, 1), "window_strides": (1, 2, 2, 1), "padding": ((0, 0),) * 4}, "pp",
     (((0,), (), (), (1,)), ((0,), (), (), (1,)), ()), (((0,), (), (), (1,)),)),
    ("rng_bit_generator", [(4,)], [(4,), (16, 32)], {}, "", (((),),), (((),), ((), ()))),
]


@pytest.mark.parametrize("prim, ins, outs, params, want_kinds, want_ins, want_outs", RULE_ROWS,
                         ids=[r[0] for r in RULE_ROWS])
def test_rule(prim, ins, outs, params, want_kinds, want_ins, want_outs):
    rule = RULES[prim](ctx(prim, ins, outs), **params)
    assert kinds(rule) == want_kinds
    assert rule.operands == want_ins and rule.results == want_outs
