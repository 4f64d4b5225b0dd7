"""Rules derived from XLA (automap.rules.derive) never contradict the hand-written ones: every
factor a derived rule claims parallel is one parallel factor of the hand rule, and for
elementwise-like ops the derivation finds all of them. Derivation runs on the op's own shapes
and params (a probe that drops dims would misread shape-dependent params)."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax

from automap.rules import RULES, RuleContext, Shaped, derive_rule

A, B = (4, 6), (6, 8)


def eqn_of(fn, *shapes, index=-1):
    """The ``index``-th equation of ``fn``'s jaxpr (calls inlined by hand: the tests use lax)."""
    args = [jax.ShapeDtypeStruct(s, jnp.float32) if isinstance(s, tuple) else s for s in shapes]
    return jax.make_jaxpr(fn)(*args).jaxpr.eqns[index]


def context(eqn):
    shaped = lambda vs: tuple(Shaped(tuple(v.aval.shape), v.aval.dtype) for v in vs)  # noqa: E731
    return RuleContext(eqn.primitive.name, shaped(eqn.invars), shaped(eqn.outvars))


def parallel_dims(rule):
    """factor -> the (value position, dim) holding it, values numbered operands then results;
    only dims of a single factor (a reshape's merged dims are left out)."""
    out = {}
    for pos, dims in enumerate(rule.operands + rule.results):
        for d, fs in enumerate(dims):
            if len(fs) == 1 and rule.factors[fs[0]].kind == "parallel":
                out.setdefault(fs[0], set()).add((pos, d))
    return out


ROWS = [
    # name, fn, shapes, elementwise-like (the derivation must find every parallel dim)
    ("add", lambda x, y: x + y, [A, A], True),
    ("exp", jnp.exp, [A], True),
    ("max", lax.max, [A, A], True),
    ("select_n", lambda x, y: lax.select(x > 0, x, y), [A, A], True),
    ("convert", lambda x: x.astype(jnp.bfloat16), [A], True),
    ("integer_pow", lambda x: x**3, [A], True),
    ("transpose", lambda x: x.T, [A], True),
    ("transpose_3d", lambda x: x.transpose(2, 0, 1), [(2, 4, 6)], True),
    ("reduce_sum", lambda x: x.sum(1), [A], False),
    ("reduce_max", lambda x: x.max(0), [A], False),
    ("argmax", lambda x: jnp.argmax(x, 1), [A], False),
    ("cumsum", lambda x: lax.cumsum(x, 1), [A], False),
    ("sort", lambda x: lax.sort(x, dimension=0), [A], False),
    ("broadcast_in_dim", lambda x: jnp.broadcast_to(x, (4, 6)), [(6,)], False),
    ("broadcast_size1", lambda x: jnp.broadcast_to(x, (4, 6)), [(4, 1)], False),
    ("dot_general", lambda x, w: x @ w, [A, B], False),
    ("batched_dot", lambda x, y: jnp.einsum("bij,bjk->bik", x, y), [(2, 4, 6), (2, 6, 8)], False),
    ("concatenate", lambda x, y: jnp.concatenate([x, y], 1), [A, A], False),
    ("reshape_split", lambda x: x.reshape(4, 2, 3), [A], False),
    ("reshape_merge", lambda x: x.reshape(24), [A], False),
    ("pad", lambda x: lax.pad(x, 0.0, ((0, 0, 0), (1, 1, 0))), [A], False),
    ("slice", lambda x: x[:, 1:5], [A], False),
    ("rev", lambda x: lax.rev(x, (1,)), [A], False),
    ("squeeze", lambda x: x[:, 0], [(4, 1)], False),
    ("dynamic_slice", lambda x, i: lax.dynamic_slice_in_dim(x, i, 2, 1), [A, jnp.int32(1)], False),
    ("gather_rows", lambda x, i: x[i], [(8, 6), jax.ShapeDtypeStruct((4,), jnp.int32)], False),
    ("stack", lambda x, y: jnp.stack([x, y], 1), [A, A], False),
    ("tile", lambda x: jnp.tile(x, (2, 1)), [A], False),
]


@pytest.mark.parametrize("fn, shapes, elementwise", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_derived_rule_never_contradicts_the_hand_rule(fn, shapes, elementwise):
    eqn = eqn_of(fn, *shapes)
    ctx = context(eqn)
    hand = RULES[ctx.primitive](ctx, **eqn.params)
    derived = derive_rule(eqn.primitive, ctx, eqn.params)
    assert derived.rule is not None, derived.reason
    assert not derived.rule.reduction_factors  # derivation never claims a reduction
    hand_dims = parallel_dims(hand)
    hand_factor_of = {where: f for f, dims in hand_dims.items() for where in dims}
    for f, dims in parallel_dims(derived.rule).items():
        owners = {hand_factor_of.get(where) for where in dims}
        assert len(owners) == 1 and None not in owners, (
            f"derived factor {f} on {sorted(dims)} is not one parallel factor of the hand rule {hand}")
    if elementwise:
        want = {where for f, dims in hand_dims.items() for where in dims if hand.factors[f].size % 2 == 0}
        got = {where for dims in parallel_dims(derived.rule).values() for where in dims}
        assert got == want


def test_derivation_is_cached_and_reports_why_it_fails():
    eqn = eqn_of(lambda x, y: x + y, A, A)
    first = derive_rule(eqn.primitive, context(eqn), eqn.params)
    assert derive_rule(eqn.primitive, context(eqn), eqn.params) is first
    debug = eqn_of(lambda x: jax.debug.print("{}", x), A)
    got = derive_rule(debug.primitive, context(debug), debug.params)
    assert got.rule is None and "side effects" in got.reason
