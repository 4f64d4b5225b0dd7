"""GPT-2 style decoder in flax linen (`gpt_linen`), with the parameter layout shared by `gpt_nnx`.

Parameter leaves (paths from the train state; ``L`` = layers, ``D`` = d_model, ``H`` = heads,
``Dh`` = head_dim, ``F`` = mlp_ratio * d_model, ``V`` = vocab, ``S`` = seq)::

    params/wte/embedding                (V, D)
    params/wpe/embedding                (S, D)
    params/blocks_{i}/ln1/{scale,bias}  (D,)
    params/blocks_{i}/attn/qkv/kernel   (D, 3, H, Dh)     bias (3, H, Dh)
    params/blocks_{i}/attn/{q,k,v}/kernel (D, H, Dh)      bias (H, Dh)    [separate_qkv=True]
    params/blocks_{i}/attn/q/kernel     (D, H, Dh)        bias (H, Dh)    [kv_heads=K < H]
    params/blocks_{i}/attn/{k,v}/kernel (D, K, Dh)        bias (K, Dh)    [kv_heads=K < H]
    params/blocks_{i}/attn/out/kernel   (H, Dh, D)        bias (D,)
    params/blocks_{i}/ln2/{scale,bias}  (D,)
    params/blocks_{i}/mlp/up/kernel     (D, F)            bias (F,)
    params/blocks_{i}/mlp/gate/kernel   (D, F)            bias (F,)       [gated_mlp=True only]
    params/blocks_{i}/mlp/down/kernel   (F, D)            bias (D,)
    params/ln_f/{scale,bias}            (D,)
    params/head/kernel                  (D, V)            bias (V,)

With ``scan=True`` the ``blocks_{i}`` subtrees are replaced by one ``blocks`` subtree whose leaves
have a leading ``L`` axis, e.g. ``params/blocks/mlp/up/kernel`` of shape ``(L, D, F)``. The Adam
moments ``opt_state[1][0].mu`` / ``.nu`` mirror the ``params`` tree.

Blocks are pre-LN: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``; the MLP is ``down(gelu(up(x)))``
or, gated, ``down(silu(gate(x)) * up(x))``. Kernels and embeddings are N(0, 0.02), biases zero,
layer-norm scales one (drawn on the host per leaf path, so `gpt_nnx` gets the same values).

>>> from automap import zoo
>>> w = zoo.gpt_linen(zoo.GPTConfig(layers=2, scan=True, d_model=32, heads=2, vocab=64, seq=8))
>>> w.name
'gpt_linen_l2_scan'
>>> w.abstract()[0]["params"]["blocks"]["attn"]["qkv"]["kernel"].shape
(2, 32, 3, 2, 16)
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

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

_INIT = nn.initializers.normal(stddev=0.02)
_EPS = 1e-5


class _Module(nn.Module):
    cfg: GPTConfig

    def drop(self, x):
        if self.cfg.dropout == 0.0:
            return x
        return dropout(x, self.cfg.dropout, self.make_rng("dropout"))


class Attention(_Module):
    """Causal multi-head self-attention (fused ``qkv`` or separate ``q``/``k``/``v``; grouped
    key/value heads with ``cfg.kv_heads``)."""

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        dense = functools.partial(nn.DenseGeneral, kernel_init=_INIT)
        if not cfg.fused_qkv:
            q = dense((cfg.heads, cfg.head_dim), name="q")(x)
            k, v = (dense((cfg.num_kv_heads, cfg.head_dim), name=n)(x) for n in ("k", "v"))
        else:
            qkv = dense((3, cfg.heads, cfg.head_dim), name="qkv")(x)
            q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
        key = self.make_rng("dropout") if cfg.dropout > 0 else None
        y = causal_attention(q, k, v, rate=cfg.dropout, key=key)
        return dense(cfg.d_model, axis=(-2, -1), name="out")(y)


class MLP(_Module):
    """``down(gelu(up(x)))``, or SwiGLU ``down(silu(gate(x)) * up(x))`` when ``cfg.gated_mlp``."""

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        up = nn.Dense(cfg.hidden, kernel_init=_INIT, name="up")
        if cfg.gated_mlp:
            h = jax.nn.silu(nn.Dense(cfg.hidden, kernel_init=_INIT, name="gate")(x)) * up(x)
        else:
            h = jax.nn.gelu(up(x))
        return nn.Dense(cfg.d_model, kernel_init=_INIT, name="down")(h)


class Block(_Module):
    """Pre-LN transformer block; ``(carry, xs) -> (carry, None)`` so it can be scanned."""

    @nn.compact
    def __call__(self, x, _=None):
        cfg = self.cfg
        x = x + self.drop(Attention(cfg, name="attn")(nn.LayerNorm(_EPS, name="ln1")(x)))
        x = x + self.drop(MLP(cfg, name="mlp")(nn.LayerNorm(_EPS, name="ln2")(x)))
        return x, None


class GPT(_Module):
    """Token + position embeddings, ``cfg.layers`` blocks (unrolled or scanned), ln_f, head."""

    @nn.compact
    def __call__(self, tokens):
        cfg = self.cfg
        x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=_INIT, name="wte")(tokens)
        pos = nn.Embed(cfg.seq, cfg.d_model, embedding_init=_INIT, name="wpe")(
            jnp.arange(tokens.shape[1])
        )
        x = self.drop(x + pos[None])
        block = nn.remat(Block, prevent_cse=not cfg.scan) if cfg.remat else Block
        if cfg.scan:
            stack = nn.scan(
                block,
                variable_axes={"params": 0},
                split_rngs={"params": True, "dropout": True},
                length=cfg.layers,
            )
            x, _ = stack(cfg, name="blocks")(x, None)
        else:
            for i in range(cfg.layers):
                x, _ = block(cfg, name=f"blocks_{i}")(x, None)
        x = nn.LayerNorm(_EPS, name="ln_f")(x)
        return nn.Dense(cfg.vocab, kernel_init=_INIT, name="head")(x)


def gpt_linen(cfg: GPTConfig | None = None) -> Workload:
    """The GPT-2 style decoder of `cfg` as a flax linen `Workload` (layout in the module docstring).

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.gpt_linen(zoo.GPTConfig(layers=1, d_model=32, heads=2, vocab=64, seq=8, batch=2))
    >>> state, batch = w.init(0)
    >>> loss = w.loss_fn(state["params"], batch)  # eager; jax.jit(w.train_step) trains
    >>> bool(abs(float(loss) - jax.numpy.log(64)) < 0.1)  # ~ uniform over the vocab at init
    True
    """
    cfg = GPTConfig() if cfg is None else cfg
    model = GPT(cfg)

    def abstract_params():  # shapes only: the values come from `gpt_fill_param`
        def init(tokens):
            key = jax.random.key(0)
            return model.init({"params": key, "dropout": key}, tokens)["params"]

        return jax.eval_shape(init, jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32))

    def loss_fn(params, batch):
        key = dropout_key(batch)
        rngs = {} if key is None else {"dropout": key}
        logits = model.apply({"params": params}, batch["tokens"], rngs=rngs)
        return lm_loss(logits, batch["targets"])

    return make_workload(
        gpt_name("gpt_linen", cfg),
        cfg,
        loss_fn=loss_fn,
        abstract_params=abstract_params,
        fill_param=gpt_fill_param,
        abstract_batch=functools.partial(gpt_abstract_batch, cfg),
        make_batch=functools.partial(gpt_batch, cfg),
        learning_rate=cfg.learning_rate,
    )
