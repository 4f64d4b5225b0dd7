"""Fused attention: cuDNN's ``dot_product_attention`` (``jax.nn.dot_product_attention(...,
implementation="cudnn")`` on NVIDIA GPUs), which traces to ``dot_product_attention_fwd_wrapper``
(and ``..._bwd_wrapper`` under ``grad``).

The rules follow what JAX's own partitioner of the op accepts (``jax._src.cudnn``): batch and
heads may be sharded, alike in query, key, value, bias and every result; the query and key/value
sequence dims and the head dims must stay whole (JAX raises "Sharding on sequence dim is not
allowed"). With grouped-query attention (fewer key/value heads than query heads) query, key and
value cannot share a heads sharding, so heads stay whole.

Operands of the forward op: ``query, key, value, bias, q_seqlen, kv_seqlen, q_offsets,
kv_offsets, page_table_k, page_table_v`` (absent ones are empty arrays); results: ``output`` and,
when training, the softmax statistics ``[batch * segments, heads, q_seq]``. The backward op
takes those plus ``activation, fwd_output, grad_output`` and returns the gradients of query,
key, value (and bias).
"""
from __future__ import annotations

from typing import Any

import math

from automap.rules.registry import FactorRule, RuleContext, Shaped, einsum, register
from automap.rules.traits import Traits


def _attention_flops(ctx: RuleContext, *, layout: int = 0, **_: Any) -> int:
    """Two matmuls per (query, key) pair: ``4 * |q| * kv_len``, the key's sequence dim read off
    the layout (``BNTH``: dim 2, ``BTNH``: dim 1)."""
    q, k = ctx.operands[0].shape, ctx.operands[1].shape
    return 4 * math.prod(q) * k[2 if layout == BNTH else 1]


# fused attention: its own kernel, its results pinned like a contraction's (the backward ~2.5x)
ATTENTION = Traits(_attention_flops, "kernel", "kernel", emit="pin")
ATTENTION_BWD = Traits(lambda ctx, **p: 5 * _attention_flops(ctx, **p) // 2, "kernel", "kernel", emit="pin")

BNTH = 1  # AttentionLayout.BNTH.value in jax._src.cudnn.fused_attention_stablehlo (BTNH is 0)


def _attention_rule(ctx: RuleContext, layout: int, roles_in: tuple[str, ...], roles_out: tuple[str, ...]) -> FactorRule:
    """Letters: ``b`` batch, ``n`` heads; every other dim ``.`` (whole). A role names the
    layout of a value: ``q`` (query-like, also key/value and their gradients), ``bias``
    ``[b, n, t, s]``, ``stat`` ``[b, n, t]``; anything else is whole."""
    query = ctx.operands[0]
    batch, heads = (0, 1) if layout == BNTH else (0, 2)
    nb, nh = query.shape[batch], query.shape[heads]
    kv_heads = {ctx.operands[i].shape[heads] for i in (1, 2)}
    share_heads = kv_heads == {nh}

    def term(role: str, s: Shaped) -> str:
        chars = ["."] * s.ndim
        if role == "q" and s.ndim == query.ndim:
            dims = {batch: ("b", nb), heads: ("n", nh)}
        elif role in ("bias", "stat") and s.ndim == (4 if role == "bias" else 3):
            dims = {0: ("b", nb), 1: ("n", nh)}
        else:
            return "".join(chars)
        for d, (c, size) in dims.items():
            if s.shape[d] == size and (c == "b" or share_heads):
                chars[d] = c
        return "".join(chars)

    ins = [term(r, s) for r, s in zip(roles_in, ctx.operands, strict=False)]
    ins += ["." * s.ndim for s in ctx.operands[len(ins):]]
    outs = [term(r, s) for r, s in zip(roles_out, ctx.results, strict=False)]
    outs += ["." * s.ndim for s in ctx.results[len(outs):]]
    return einsum(ctx, ",".join(ins) + "->" + ",".join(outs))


@register("dot_product_attention_fwd_wrapper", traits=ATTENTION)
def _attention_fwd(ctx: RuleContext, *, layout: int, **_: Any) -> FactorRule:
    return _attention_rule(ctx, layout, ("q", "q", "q", "bias"), ("q", "stat"))


@register("dot_product_attention_bwd_wrapper", traits=ATTENTION_BWD)
def _attention_bwd(ctx: RuleContext, *, layout: int, **_: Any) -> FactorRule:
    roles_in = ("q", "q", "q", "bias") + ("",) * 6 + ("stat", "q", "q")
    return _attention_rule(ctx, layout, roles_in, ("q", "q", "q", "bias"))
