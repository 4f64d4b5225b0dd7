"""cuDNN fused attention (``jax.nn.dot_product_attention(..., implementation="cudnn")``): batch
and heads shared by query, key, value, bias and the results; sequences and head dims whole.
The op traces only where cuDNN is present, so its rules are checked on a RuleContext."""
import jax.numpy as jnp
import pytest

from automap.rules import RULES, RuleContext, Shaped

B, T, S, N, H = 2, 8, 16, 4, 32
BF16 = jnp.bfloat16
EMPTY = (0,)  # absent optional operands are empty arrays


def ctx(primitive, ins, outs):
    return RuleContext(primitive, tuple(Shaped(s, BF16) for s in ins), tuple(Shaped(s, BF16) for s in outs))


def letters_of(rule, dims_list):
    """Each value's dims as letters: 'b' for the factor of the query's batch dim, 'n' heads,
    '.' for a dim without factor; any other factor fails the test."""
    names = {}
    out = []
    for dims in dims_list:
        term = ""
        for fs in dims:
            if not fs:
                term += "."
                continue
            (f,) = fs
            assert rule.factors[f].kind == "parallel"
            if f not in names:
                names[f] = "bn"[len(names)]
            term += names[f]
        out.append(term)
    return out


FWD_ROWS = [
    # layout, q, k, v, bias, results, expected operand terms (q, k, v, bias), result terms
    ("btnh_training", 0, (B, T, N, H), (B, S, N, H), (B, S, N, H), EMPTY, [(B, T, N, H), (B, N, T)],
     ["b.n.", "b.n.", "b.n.", "."], ["b.n.", "bn."]),
    ("bnth_bias", 1, (B, N, T, H), (B, N, S, H), (B, N, S, H), (B, N, T, S), [(B, N, T, H)],
     ["bn..", "bn..", "bn..", "bn.."], ["bn.."]),
    ("bias_broadcast", 0, (B, T, N, H), (B, S, N, H), (B, S, N, H), (1, N, T, S), [(B, T, N, H)],
     ["b.n.", "b.n.", "b.n.", ".n.."], ["b.n."]),
    # grouped-query attention: fewer key/value heads, so heads stay whole
    ("gqa", 0, (B, T, N, H), (B, S, 2, H), (B, S, 2, H), EMPTY, [(B, T, N, H), (B, N, T)],
     ["b...", "b...", "b...", "."], ["b...", "b.."]),
]


@pytest.mark.parametrize("layout, q, k, v, bias, outs, want_ins, want_outs", [r[1:] for r in FWD_ROWS],
                         ids=[r[0] for r in FWD_ROWS])
def test_attention_fwd(layout, q, k, v, bias, outs, want_ins, want_outs):
    ins = [q, k, v, bias] + [EMPTY] * 6
    rule = RULES["dot_product_attention_fwd_wrapper"](ctx("dot_product_attention_fwd_wrapper", ins, outs),
                                                      layout=layout, scale=1.0, is_training=len(outs) == 2)
    terms = letters_of(rule, rule.operands + rule.results)
    assert terms[:4] == want_ins and set(terms[4:10]) == {"."}
    assert terms[10:] == want_outs


def test_attention_bwd():
    q, kv, stat = (B, T, N, H), (B, S, N, H), (B, N, T)
    ins = [q, kv, kv, EMPTY] + [EMPTY] * 6 + [stat, q, q]
    outs = [q, kv, kv]
    rule = RULES["dot_product_attention_bwd_wrapper"](ctx("dot_product_attention_bwd_wrapper", ins, outs), layout=0)
    terms = letters_of(rule, rule.operands + rule.results)
    assert terms[:3] == ["b.n."] * 3 and terms[10:13] == ["bn.", "b.n.", "b.n."]
    assert terms[13:] == ["b.n."] * 3
