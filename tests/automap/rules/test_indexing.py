"""Indexing: gather (embedding lookups: a sharded vocab is a partial sum), scatter-add (their
gradients), scatter, dynamic_slice and dynamic_update_slice."""
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from harness import MESH_8, check, ints, row

V, D = 32, 16  # vocab, d_model
TOK = ints((8, 8), V)  # (batch, seq) token ids
embed = lambda emb, tokens: emb[tokens]  # noqa: E731
embed_vmapped = lambda emb, tokens: jax.vmap(jax.vmap(lambda t: emb[t]))(tokens)  # noqa: E731
embed_grad = lambda tokens, g: jnp.zeros((V, D)).at[tokens].add(g)  # noqa: E731
embed_grad_into = lambda acc, tokens, g: acc.at[tokens].add(g)  # noqa: E731
xent = lambda logits, labels: jnp.take_along_axis(logits, labels[:, None], axis=1)[:, 0]  # noqa: E731


def xent_loss(logits, labels):
    return jax.nn.logsumexp(logits, axis=-1) - xent(logits, labels)


ROWS = [
    # name, fn, args, input specs, output spec, collective kinds
    # gather: embedding lookups
    row("embed_vocab_sharded", embed, [(V, D), TOK], {"emb": P("model")}, P(), {"all-reduce"}),
    row("embed_dmodel_sharded", embed, [(V, D), TOK], {"emb": P(None, "model")}, P(None, None, "model"), set()),
    row("embed_tokens_sharded", embed, [(V, D), TOK], {"tokens": P("data")}, P("data"), set()),
    row("embed_dp_tp", embed, [(V, D), TOK], {"emb": P(None, "model"), "tokens": P("data")},
        P("data", None, "model"), set()),
    row("embed_dp_vocab", embed, [(V, D), TOK], {"emb": P("model"), "tokens": P("data", None)}, P("data"),
        {"all-reduce"}),
    row("embed_vocab_and_dmodel", embed, [(V, D), TOK], {"emb": P("model", "data")}, P(None, None, "data"),
        {"all-reduce"}),
    # equinox's Embedding (``weight[i]`` under vmap): every dim of the table is indexed, the row
    # by a size-1 slice kept in the result, the features by a whole-dim slice
    row("embed_vmapped_vocab_sharded", embed_vmapped, [(V, D), TOK], {"emb": P("model")}, P(), {"all-reduce"}),
    row("embed_vmapped_dmodel_sharded", embed_vmapped, [(V, D), TOK], {"emb": P(None, "model")},
        P(None, None, "model"), set()),
    row("take_rows", lambda x, i: x[i], [(V, D), ints((4,), V)], {"x": P(None, "model")}, P(None, "model"), set()),
    # take_along_axis (cross-entropy labels): gather with batching dims
    row("take_along_batch", xent, [(16, V), ints((16,), V)], {"logits": P("data"), "labels": P("data")},
        P("data"), set()),
    row("take_along_classes_sharded", xent, [(16, V), ints((16,), V)], {"logits": P("data", "model")},
        P("data"), {"all-reduce"}),
    # its gradient: a scatter-add with batching dims, the updates' batch dim the operand's (no gather of them)
    row("take_along_grad_batch", lambda x, i, g: jax.vjp(lambda x: xent(x, i), x)[1](g)[0],
        [(16, V), ints((16,), V), (16,)], {"x": P("data"), "i": P("data"), "g": P("data")}, P("data"), set()),
    # the cross-entropy of vocab-parallel logits: two partial results (the logsumexp's max and
    # sum) and the label's logit
    row("xent_vocab_parallel", xent_loss, [(16, V), ints((16,), V)],
        {"logits": P("data", "model"), "labels": P("data")},
        P("data"), {"all-reduce"}, inner={"gather": P("data")}),
    # scatter-add: embedding gradients
    row("embed_grad_dmodel", embed_grad, [TOK, (8, 8, D)], {"g": P(None, None, "model")}, P(None, "model"), set()),
    row("embed_grad_dp", embed_grad, [TOK, (8, 8, D)], {"tokens": P("data"), "g": P("data")}, P(), {"all-reduce"}),
    row("embed_grad_dp_tp", embed_grad, [TOK, (8, 8, D)], {"tokens": P("data"), "g": P("data", None, "model")},
        P(None, "model"), {"all-reduce"}),
    # equinox's: every dim of the table indexed, the features' whole-dim window still passes
    # through to the updates (Shardy's rule: ([k, m], [i, j, n], [i, j, l, m])->([k, m]))
    row("embed_vmapped_grad_dmodel", lambda e, tokens, g: jax.vjp(lambda e: embed_vmapped(e, tokens), e)[1](g)[0],
        [(V, D), TOK, (8, 8, D)], {"g": P(None, None, "model")}, P(None, "model"), set()),
    row("embed_grad_vocab_sharded", embed_grad_into, [(V, D), TOK, (8, 8, D)], {"acc": P("model")}, P("model"),
        set()),
    # the accumulator counts once, however the updates are split
    row("scatter_add_into_acc", embed_grad_into, [(V, D), TOK, (8, 8, D)], {"tokens": P("data"), "g": P("data")},
        P(), {"all-reduce"}),
    row("scatter_max", lambda x, i, u: x.at[i].max(u), [(V, D), ints((8,), V), (8, D)], {"x": P(None, "model")},
        P(None, "model"), set(), inner={"scatter-max": P(None, "model")}),
    row("scatter_mul_updates_split", lambda x, i, u: x.at[i].mul(u), [(V, D), ints((8,), V), (8, D)],
        {"u": P("x")}, P(), {"all-reduce"}, mesh=MESH_8),
    # scatter (overwrite): the update's batch dims may not be split
    row("scatter_set_rows", lambda x, i, u: x.at[i].set(u), [(V, D), ints((4,), 4), (4, D)],
        {"x": P(None, "model")}, P(None, "model"), set()),
    # dynamic_slice / dynamic_update_slice
    row("dynamic_slice_other_dim", lambda x, i: lax.dynamic_slice(x, (i, 0), (4, 32)), [(16, 32), ints((), 12)],
        {"x": P(None, "model")}, P(None, "model"), set()),
    row("dynamic_slice_sliced_dim", lambda x, i: lax.dynamic_slice(x, (i,), (8,)), [(32,), ints((), 24)],
        {"x": P("x")}, P(), {"all-gather"}, mesh=MESH_8),
    row("dynamic_index", lambda x, i: x[i], [(16, 32), ints((), 16)], {"x": P(None, "model")}, P("model"), set()),
    row("dus_other_dim", lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)), [(16, 32), (4, 32), ints((), 12)],
        {"x": P(None, "model")}, P(None, "model"), set(), inner={"dynamic_update_slice": P(None, "model")}),
    row("dus_update_sharded", lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
        [(16, 32), (4, 32), ints((), 12)], {"u": P(None, "model")}, P(None, "model"), set()),
    row("dus_sliced_dim", lambda x, u, i: lax.dynamic_update_slice(x, u, (i,)), [(32,), (8,), ints((), 24)],
        {"x": P("x")}, P(), {"all-gather"}, mesh=MESH_8),
    # scatter-sub: like scatter-add
    row("scatter_sub_columns", lambda x, u: x.at[jnp.array([1, 5, 9])].subtract(u), [(16, 32), (3, 32)],
        {"x": P(None, "model"), "u": P(None, "model")}, P(None, "model"), set()),
]


@pytest.mark.parametrize("r", ROWS)
def test_indexing(r):
    check(r)
