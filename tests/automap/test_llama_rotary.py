"""Issue 17's headline case: a pure-JAX Llama-style decoder whose rotary embedding uses
``jnp.stack``. With a factor rule for ``stack`` the data flow is not cut: ``data_parallel`` finds
the batch, ``schedule(data_parallel, megatron)`` shards q/k/v/o on heads and the gated MLP on
its hidden dim, and the sharded step equals the unsharded one."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import automap
import tactics

VOCAB, D, HEADS, HEAD_DIM, FF, SEQ, BATCH, LAYERS = 32, 32, 4, 8, 64, 8, 4, 2
MESH = automap.make_mesh({"data": 2, "model": 4})


def init(seed=0):
    rng = np.random.default_rng(seed)
    w = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.1, jnp.float32)  # noqa: E731
    layer = lambda: {  # noqa: E731
        "attn_norm": jnp.ones(D), "wq": w(D, HEADS * HEAD_DIM), "wk": w(D, HEADS * HEAD_DIM),
        "wv": w(D, HEADS * HEAD_DIM), "wo": w(HEADS * HEAD_DIM, D), "mlp_norm": jnp.ones(D),
        "w_gate": w(D, FF), "w_up": w(D, FF), "w_down": w(FF, D),
    }
    params = {"embed": w(VOCAB, D), "layers": [layer() for _ in range(LAYERS)], "norm": jnp.ones(D),
              "lm_head": w(D, VOCAB)}
    tokens = jnp.asarray(rng.integers(0, VOCAB, (BATCH, SEQ + 1)), jnp.int32)
    return params, {"tokens": tokens}


def rms_norm(x, scale):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6) * scale


def rotary(x):
    """[b, s, h, d] rotated in pairs; the pairs are put back together with ``jnp.stack``."""
    s, d = x.shape[1], x.shape[-1]
    freqs = 1.0 / (10000 ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    angles = jnp.arange(s, dtype=jnp.float32)[:, None] * freqs  # [s, d/2]
    cos, sin = jnp.cos(angles)[None, :, None], jnp.sin(angles)[None, :, None]
    pairs = x.reshape(*x.shape[:-1], d // 2, 2)
    x1, x2 = pairs[..., 0], pairs[..., 1]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(x.shape)


def attention(p, x):
    b, s, _ = x.shape
    q = rotary((x @ p["wq"]).reshape(b, s, HEADS, HEAD_DIM))
    k = rotary((x @ p["wk"]).reshape(b, s, HEADS, HEAD_DIM))
    v = (x @ p["wv"]).reshape(b, s, HEADS, HEAD_DIM)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(HEAD_DIM)
    logits = jnp.where(jnp.tril(jnp.ones((s, s), bool)), logits, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, -1), v)
    return out.reshape(b, s, HEADS * HEAD_DIM) @ p["wo"]


def loss_fn(params, batch):
    tokens = batch["tokens"]
    x = params["embed"][tokens[:, :-1]]
    for p in params["layers"]:
        x = x + attention(p, rms_norm(x, p["attn_norm"]))
        h = rms_norm(x, p["mlp_norm"])
        x = x + (jax.nn.silu(h @ p["w_gate"]) * (h @ p["w_up"])) @ p["w_down"]
    logits = rms_norm(x, params["norm"]) @ params["lm_head"]
    labels = jax.nn.one_hot(tokens[:, 1:], VOCAB)
    return -jnp.mean(jnp.sum(labels * jax.nn.log_softmax(logits), -1))


def train_step(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss


def specs_by_path(plan):
    leaves = jax.tree_util.tree_leaves_with_path(plan.in_shardings[0])
    return {jax.tree_util.keystr(path): s.spec for path, s in leaves}


@pytest.fixture(scope="module")
def args():
    return init()


def test_data_parallel_finds_the_batch(args):
    plan = automap.automap(train_step, mesh=MESH, tactics=[tactics.data_parallel("data")], search=None,
                           strict=True).plan(*args)
    assert plan.in_shardings[1]["tokens"].spec == P("data")
    assert not any("no data input has a batch dim" in n for n in plan.notes), plan.notes


def test_megatron_shards_attention_on_heads_and_equals_unsharded(args):
    schedule = tactics.schedule(tactics.data_parallel("data"), tactics.megatron("model"))
    step = automap.automap(train_step, mesh=MESH, tactics=[schedule], search=None, strict=True)
    plan = step.plan(*args)
    specs = specs_by_path(plan)
    for i in range(LAYERS):
        for name in ("wq", "wk", "wv", "w_gate", "w_up"):  # columns: heads (and MLP hidden) split
            assert specs[f"['layers'][{i}]['{name}']"] == P(None, "model"), (name, specs)
        for name in ("wo", "w_down"):  # rows
            assert specs[f"['layers'][{i}]['{name}']"] == P("model"), (name, specs)
    assert plan.in_shardings[1]["tokens"].spec == P("data")
    (new_params, loss) = step(*args)
    ref_params, ref_loss = jax.jit(train_step)(*args)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(ref_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
