"""The rule table: the einsum builder, the family helpers, the replicate-around default and the
strict-mode error for a primitive without a rule."""
import warnings

import jax
import jax.numpy as jnp
import pytest
from jax.extend.core import Primitive
from jax.interpreters import mlir
from jax.sharding import PartitionSpec as P

import automap
from automap.rules import (
    RULES, MissingRuleError, MissingRuleWarning, RuleContext, Shaped, covered, def_blocked_along, def_elementwise,
    def_reduce, einsum, has_rule, register,
)
from automap.rules import derive
from automap.rules.registry import rule_for
from harness import check, row

# a primitive automap has never heard of: doubles its operand
double_p = Primitive("automap_test_double")
double_p.def_impl(lambda x: x * 2)
double_p.def_abstract_eval(lambda x: x)
mlir.register_lowering(double_p, mlir.lower_fun(lambda x: x * 2, multiple_results=False))
NAME = double_p.name

# a primitive XLA cannot compile (no lowering): no rule can be derived for it
opaque_p = Primitive("automap_test_opaque")
opaque_p.def_abstract_eval(lambda x: x)
OPAQUE = opaque_p.name


def opaque_plus(x, y):
    return opaque_p.bind(x) + y


def double_plus(x, y):
    return double_p.bind(x) + y


@pytest.fixture
def rules_table():
    """Rules registered by a test are removed after it."""
    saved = dict(RULES)
    yield RULES
    RULES.clear()
    RULES.update(saved)


def ctx(operands, results, primitive="test"):
    f32 = jnp.float32
    return RuleContext(primitive, tuple(Shaped(s, f32) for s in operands), tuple(Shaped(s, f32) for s in results))


def kinds(rule):
    return "".join(f.kind[0] for f in rule.factors)  # p(arallel) r(eduction) b(locked)


# ---------------------------------------------------------------------------------------------
# the einsum builder

EINSUM_ROWS = [
    # spec, operand shapes, result shapes, blocked, factor kinds, operand dims, result dims
    ("bmk,bkn->bmn", [(2, 4, 8), (2, 8, 16)], [(2, 4, 16)], "", "pprp",
     (((0,), (1,), (2,)), ((0,), (2,), (3,))), (((0,), (1,), (3,)),)),
    ("ab->a", [(4, 8)], [(4,)], "", "pr", (((0,), (1,)),), (((0,),),)),
    ("ab->ab", [(4, 8)], [(4, 8)], "b", "pb", (((0,), (1,)),), (((0,), (1,)),)),
    ("ab,->ab", [(4, 8), ()], [(4, 8)], "", "pp", (((0,), (1,)), ()), (((0,), (1,)),)),
    ("a.->a", [(4, 1)], [(4,)], "", "p", (((0,), ()),), (((0,),),)),
    ("->ab", [], [(4, 8)], "", "pp", (), (((0,), (1,)),)),
    ("ab->ab,ab", [(4, 8)], [(4, 8), (4, 8)], "", "pp", (((0,), (1,)),), (((0,), (1,)), ((0,), (1,)))),
]


@pytest.mark.parametrize("spec, ins, outs, blocked, want_kinds, want_ins, want_outs", EINSUM_ROWS,
                         ids=[r[0] for r in EINSUM_ROWS])
def test_einsum_builder(spec, ins, outs, blocked, want_kinds, want_ins, want_outs):
    rule = einsum(ctx(ins, outs), spec, blocked=blocked)
    assert kinds(rule) == want_kinds
    assert rule.operands == want_ins and rule.results == want_outs
    sizes = {f: s for shape, dims in zip(ins + outs, want_ins + want_outs) for s, d in zip(shape, dims) for f in d}
    assert tuple(f.size for f in rule.factors) == tuple(sizes[i] for i in range(len(rule.factors)))
    assert rule.reduction_factors == tuple(i for i, k in enumerate(want_kinds) if k == "r")


@pytest.mark.parametrize("spec, ins, outs", [
    ("ab->ab", [(4, 8, 2)], [(4, 8, 2)]),  # a term with the wrong rank
    ("ab,bc->ac", [(4, 8)], [(4, 2)]),  # the wrong number of operands
])
def test_einsum_builder_rejects(spec, ins, outs):
    with pytest.raises(ValueError, match="rule"):
        einsum(ctx(ins, outs), spec)


# ---------------------------------------------------------------------------------------------
# family helpers register many primitives in one line

HELPER_ROWS = [
    # helper, helper kwargs, operand shapes, result shapes, params, factor kinds, operand dims, result dims
    (def_elementwise, {}, [(16, 32), (1, 32), ()], [(16, 32)], {}, "pp",
     (((0,), (1,)), ((), (1,)), ()), (((0,), (1,)),)),
    (def_reduce, {}, [(16, 32, 8)], [(32,)], {"axes": (0, 2)}, "rpr", (((0,), (1,), (2,)),), (((1,),),)),
    (def_blocked_along, {"param": "axis"}, [(16, 32)], [(16, 32)], {"axis": -1}, "pb",
     (((0,), (1,)),), (((0,), (1,)),)),
    (def_blocked_along, {"param": "dimension"}, [(16, 32), (16, 32)], [(16, 32), (16, 32)], {"dimension": 0}, "bp",
     (((0,), (1,)), ((0,), (1,))), (((0,), (1,)), ((0,), (1,)))),
]


@pytest.mark.parametrize("helper, kw, ins, outs, params, want_kinds, want_ins, want_outs", HELPER_ROWS,
                         ids=["elementwise", "reduce", "blocked_axis", "blocked_multi_operand"])
def test_family_helpers(rules_table, helper, kw, ins, outs, params, want_kinds, want_ins, want_outs):
    helper("automap_test_a", "automap_test_b", **kw)
    assert has_rule("automap_test_a") and has_rule("automap_test_b")
    rule = RULES["automap_test_b"](ctx(ins, outs, "automap_test_b"), **params, some_future_param=1)
    assert kinds(rule) == want_kinds
    assert rule.operands == want_ins and rule.results == want_outs


def test_register_by_primitive_or_name(rules_table):
    assert not has_rule(double_p) and not covered(NAME)

    @register(double_p, "automap_test_alias")
    def _rule(ctx, **_):
        return einsum(ctx, "ab->ab")

    assert RULES[NAME] is _rule and RULES["automap_test_alias"] is _rule
    assert has_rule(double_p) and covered(NAME)


@pytest.mark.parametrize("primitive", [
    # the families DESIGN.md promises
    "add", "mul", "select_n", "convert_element_type", "dot_general", "conv_general_dilated", "broadcast_in_dim",
    "transpose", "reshape", "squeeze", "reduce_sum", "reduce_max", "argmax", "cumsum", "sort", "top_k", "gather",
    "scatter-add", "scatter", "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "slice", "rev",
    "split", "iota", "random_bits", "random_wrap", "random_split", "random_fold_in",
    # handled structurally
    "scan", "cond", "while", "pjit", "jit", "custom_jvp_call", "custom_vjp_call", "checkpoint",
])
def test_covered(primitive):
    assert covered(primitive)


# ---------------------------------------------------------------------------------------------
# a primitive without a rule: an error in strict mode, replicated around (with a warning) otherwise


def test_strict_error_names_primitive_value_line_and_why():
    closed = jax.make_jaxpr(opaque_plus)(jnp.ones((16, 32)), jnp.ones((16, 32)))
    with pytest.raises(MissingRuleError, match=rf"'{OPAQUE}' \(value '{OPAQUE}', at .*test_registry\.py:\d+.*, "
                       r"operands float32\[16, 32\]\)\. No rule could be derived from XLA: XLA cannot compile it"):
        automap.lower(closed, ["x", "y"], ["out"], strict=True)


def test_strict_error_from_partition():
    step = automap.partition(opaque_plus, mesh=automap.make_mesh({"x": 8}), strict=True)
    with pytest.raises(MissingRuleError, match=OPAQUE):
        step.plan(jnp.ones((16, 32)), jnp.ones((16, 32)))


def test_unregistered_primitive_gets_a_derived_rule():
    """No hand-written rule, but XLA partitions its lowering (x * 2) elementwise: a derived rule,
    no warning, and the strict mode is satisfied."""
    closed = jax.make_jaxpr(double_plus)(jnp.ones((16, 32)), jnp.ones((16, 32)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingRuleWarning)
        program = automap.lower(closed, ["x", "y"], ["out"], strict=True)
    (op,) = [op for op in program.all_ops if op.primitive == NAME]
    assert op.has_rule and kinds(op.rule) == "pp"
    assert op.rule.operands == (((0,), (1,)),) and op.rule.results == (((0,), (1,)),)


def test_default_rule_is_replicated_with_warning():
    c = ctx([(16, 32)], [(16, 32)], NAME)
    with pytest.warns(MissingRuleWarning, match=NAME):
        rule, ok = rule_for(c, {}, strict=False)
    assert not ok and kinds(rule) == "bbbb"
    with pytest.raises(MissingRuleError, match=NAME):
        rule_for(c, {}, strict=True)


DM = P("data", "model")
REPLICATED_ROW = row(
    # the plan runs the unknown op on whole values (it prices an all-gather of x); its result is
    # then kept in the layout its user (the add, following y) wants. XLA sees the op's lowering
    # (x * 2) and partitions it anyway: nothing is gathered.
    "unregistered_replicated", double_plus, [(16, 32), (16, 32)], {"x": DM, "y": DM}, DM, set(),
    inner={NAME: DM}, strict=False, model={"all-gather"},
)
DERIVED_ROW = row("derived_elementwise", double_plus, [(16, 32), (16, 32)], {"x": DM, "y": DM}, DM, set(),
                  inner={NAME: DM})
REGISTERED_ROW = row(
    "registered_elementwise", double_plus, [(16, 32), (16, 32)], {"x": DM, "y": DM}, DM, set(), inner={NAME: DM},
)


@pytest.mark.parametrize("r", [REPLICATED_ROW])
def test_unregistered_underivable_primitive(r, monkeypatch):
    """Where no rule can be derived (here: derivation switched off), the op is replicated around."""
    monkeypatch.setattr(derive, "derive_rule", lambda *a: derive.Derivation(None, "switched off in this test"))
    with pytest.warns(MissingRuleWarning, match=NAME):
        res = check(r)
    (op,) = [op for op in res.plan.program.all_ops if op.primitive == NAME]
    assert not op.has_rule
    assert {(s.kind, s.value, s.axes) for s in res.plan.reshards} == {("all-gather", op.inputs[0], ("data", "model"))}


@pytest.mark.parametrize("r", [DERIVED_ROW])
def test_derived_primitive(r):
    check(r)


@pytest.mark.parametrize("r", [REGISTERED_ROW])
def test_registered_primitive(rules_table, r):
    def_elementwise(double_p)
    check(r)
