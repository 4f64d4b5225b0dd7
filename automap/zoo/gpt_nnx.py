"""The GPT-2 style decoder of `gpt_linen`, written in flax nnx (`gpt_nnx`).

The math and the parameter tree are identical to `automap.zoo.gpt_linen` (see its module docstring
for every leaf path and shape): ``params/wte/embedding``, ``params/blocks_0/attn/qkv/kernel``,
``params/blocks/mlp/up/kernel`` (scanned, leading ``layers`` axis), ``params/ln_f/scale``,
``params/head/kernel``, ... The train state holds the nnx state converted to a pure nested dict of
arrays (`nnx.to_pure_dict`); the loss function rebuilds the module inside the traced function with
`nnx.merge`, so the state stays a plain pytree. ``init(seed)`` gives the very values `gpt_linen`'s
does (both fill the shared layout on the host, see `automap.zoo.train.make_workload`).

Scanned models are created with `nnx.vmap` (stacked parameters) and applied with one
`jax.lax.scan` over the split block state; with ``remat=True`` the block call inside the scan body
(or each unrolled block) is wrapped in `nnx.remat`. Dropout keys come from ``batch["rng"]`` and are
split per layer explicitly.

>>> from automap import zoo
>>> w = zoo.gpt_nnx(zoo.GPTConfig(layers=2, scan=True, d_model=32, heads=2, vocab=64, seq=8))
>>> w.abstract()[0]["params"]["blocks"]["mlp"]["up"]["kernel"].shape
(2, 32, 128)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from automap.zoo.train import (
    causal_attention,
    dropout,
    dropout_key,
    gpt_abstract_batch,
    gpt_batch,
    gpt_fill_param,
    lm_loss,
    make_workload,
)
from automap.zoo.workload import GPTConfig, Workload, gpt_name

_INIT = nnx.initializers.normal(stddev=0.02)
_EPS = 1e-5


def _split(key, n):
    return (None,) * n if key is None else tuple(jax.random.split(key, n))


class Attention(nnx.Module):
    """Causal multi-head self-attention (fused ``qkv`` or separate ``q``/``k``/``v``; grouped
    key/value heads with ``cfg.kv_heads``)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        lin = functools.partial(nnx.LinearGeneral, kernel_init=_INIT, rngs=rngs)
        heads = (cfg.heads, cfg.head_dim)
        if not cfg.fused_qkv:
            self.q = lin(cfg.d_model, heads)
            self.k, self.v = (lin(cfg.d_model, (cfg.num_kv_heads, cfg.head_dim)) for _ in range(2))
        else:
            self.qkv = lin(cfg.d_model, (3,) + heads)
        self.out = lin(heads, cfg.d_model, axis=(-2, -1))

    def __call__(self, x, key=None):
        if not self.cfg.fused_qkv:
            q, k, v = self.q(x), self.k(x), self.v(x)
        else:
            qkv = self.qkv(x)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        return self.out(causal_attention(q, k, v, rate=self.cfg.dropout, key=key))


class MLP(nnx.Module):
    """``down(gelu(up(x)))``, or SwiGLU ``down(silu(gate(x)) * up(x))`` when ``cfg.gated_mlp``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        lin = functools.partial(nnx.Linear, kernel_init=_INIT, rngs=rngs)
        self.gated = cfg.gated_mlp
        if cfg.gated_mlp:
            self.gate = lin(cfg.d_model, cfg.hidden)
        self.up = lin(cfg.d_model, cfg.hidden)
        self.down = lin(cfg.hidden, cfg.d_model)

    def __call__(self, x):
        h = jax.nn.silu(self.gate(x)) * self.up(x) if self.gated else jax.nn.gelu(self.up(x))
        return self.down(h)


class Block(nnx.Module):
    """Pre-LN transformer block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.rate = cfg.dropout
        self.ln1 = nnx.LayerNorm(cfg.d_model, epsilon=_EPS, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, epsilon=_EPS, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x, key=None):
        k_attn, k_res1, k_res2 = _split(key, 3)
        x = x + dropout(self.attn(self.ln1(x), k_attn), self.rate, k_res1)
        return x + dropout(self.mlp(self.ln2(x)), self.rate, k_res2)


def _call_block(block: Block, x, key):
    return block(x, key)


class GPT(nnx.Module):
    """Token + position embeddings, ``cfg.layers`` blocks (unrolled or scanned), ln_f, head."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.wte = nnx.Embed(cfg.vocab, cfg.d_model, embedding_init=_INIT, rngs=rngs)
        self.wpe = nnx.Embed(cfg.seq, cfg.d_model, embedding_init=_INIT, rngs=rngs)
        if cfg.scan:

            @nnx.split_rngs(splits=cfg.layers)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make_blocks(rngs: nnx.Rngs):
                return Block(cfg, rngs=rngs)

            self.blocks = make_blocks(rngs)
        else:
            for i in range(cfg.layers):
                setattr(self, f"blocks_{i}", Block(cfg, rngs=rngs))
        self.ln_f = nnx.LayerNorm(cfg.d_model, epsilon=_EPS, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, kernel_init=_INIT, rngs=rngs)

    def __call__(self, tokens, key=None):
        cfg = self.cfg
        k_emb, k_layers = _split(key, 2)
        x = self.wte(tokens) + self.wpe(jnp.arange(tokens.shape[1]))[None]
        x = dropout(x, cfg.dropout, k_emb)
        call = nnx.remat(_call_block, prevent_cse=not cfg.scan) if cfg.remat else _call_block
        layer_keys = None if k_layers is None else jax.random.split(k_layers, cfg.layers)
        if cfg.scan:
            graphdef, state = nnx.split(self.blocks)

            def body(x, xs):
                block_state, layer_key = xs
                return call(nnx.merge(graphdef, block_state), x, layer_key), None

            x, _ = jax.lax.scan(body, x, (state, layer_keys), length=cfg.layers)
        else:
            for i in range(cfg.layers):
                layer_key = None if layer_keys is None else layer_keys[i]
                x = call(getattr(self, f"blocks_{i}"), x, layer_key)
        return self.head(self.ln_f(x))


def gpt_nnx(cfg: GPTConfig | None = None) -> Workload:
    """The GPT decoder of `cfg` as a flax nnx `Workload`, same parameter tree as `gpt_linen`.

    >>> import jax
    >>> from automap import zoo
    >>> cfg = zoo.GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2)
    >>> state, batch = zoo.gpt_nnx(cfg).init(0)
    >>> state["params"]["blocks_0"]["attn"]["qkv"]["kernel"].shape
    (32, 3, 2, 16)
    """
    cfg = GPTConfig() if cfg is None else cfg
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0))))

    def loss_fn(params, batch):
        state = jax.tree.map(lambda x: x, abstract_state)  # fresh container; template untouched
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(graphdef, state)(batch["tokens"], dropout_key(batch))
        return lm_loss(logits, batch["targets"])

    return make_workload(
        gpt_name("gpt_nnx", cfg),
        cfg,
        loss_fn=loss_fn,
        abstract_params=lambda: nnx.to_pure_dict(abstract_state),
        fill_param=gpt_fill_param,
        abstract_batch=functools.partial(gpt_abstract_batch, cfg),
        make_batch=functools.partial(gpt_batch, cfg),
        learning_rate=cfg.learning_rate,
    )
