"""A decoder built from equinox's layers: `eqx.nn.Embedding`, `eqx.nn.MultiheadAttention` (causal
mask), `eqx.nn.LayerNorm` and `eqx.nn.Linear`, applied per example under `jax.vmap` as equinox
layers are written. The train state's ``params`` is the array half of `eqx.partition` (the module
with ``None`` for everything that is not an array); the loss `eqx.combine`s it with the static
half. equinox is imported inside `eqx_transformer`, so `automap.zoo` does not require it.

equinox's `Linear` stores ``weight`` as (out_features, in_features): a column-parallel projection
is split on its dim 0 and a row-parallel one on its dim 1.

"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax

from automap.zoo.corpus.values import fill_param, lm_abstract_batch, lm_batch
from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class EqxTransformerConfig:
    """Sizes of the equinox decoder (``d_model`` divisible by ``heads``)."""

    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 1
    batch: int = 4
    learning_rate: float = 1e-3


def _build(cfg: EqxTransformerConfig):
    import equinox as eqx

    class Block(eqx.Module):
        ln1: eqx.nn.LayerNorm
        attn: eqx.nn.MultiheadAttention
        ln2: eqx.nn.LayerNorm
        up: eqx.nn.Linear
        down: eqx.nn.Linear

        def __init__(self, key):
            k_attn, k_up, k_down = jax.random.split(key, 3)
            self.ln1 = eqx.nn.LayerNorm(cfg.d_model)
            self.attn = eqx.nn.MultiheadAttention(cfg.heads, cfg.d_model, key=k_attn)
            self.ln2 = eqx.nn.LayerNorm(cfg.d_model)
            self.up = eqx.nn.Linear(cfg.d_model, cfg.hidden, key=k_up)
            self.down = eqx.nn.Linear(cfg.hidden, cfg.d_model, key=k_down)

        def __call__(self, x, mask):  # x: (seq, d_model), one example
            h = jax.vmap(self.ln1)(x)
            x = x + self.attn(h, h, h, mask=mask)
            h = jax.vmap(self.ln2)(x)
            return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))

    class Decoder(eqx.Module):
        embed: eqx.nn.Embedding
        blocks: list
        ln_f: eqx.nn.LayerNorm
        head: eqx.nn.Linear

        def __init__(self, key):
            k_embed, k_head, *k_blocks = jax.random.split(key, 2 + cfg.layers)
            self.embed = eqx.nn.Embedding(cfg.vocab, cfg.d_model, key=k_embed)
            self.blocks = [Block(k) for k in k_blocks]
            self.ln_f = eqx.nn.LayerNorm(cfg.d_model)
            self.head = eqx.nn.Linear(cfg.d_model, cfg.vocab, key=k_head)

        def __call__(self, tokens):  # tokens: (seq,)
            x = jax.vmap(self.embed)(tokens)
            mask = jnp.tril(jnp.ones((tokens.shape[0], tokens.shape[0]), bool))
            for block in self.blocks:
                x = block(x, mask)
            return jax.vmap(self.head)(jax.vmap(self.ln_f)(x))

    model = eqx.filter_eval_shape(Decoder, jax.random.key(0))  # Python fields stay as they are
    # eqx.is_inexact_array on the abstract module: its float leaves are the parameters
    return eqx.partition(model, lambda x: isinstance(x, jax.ShapeDtypeStruct) and jnp.issubdtype(x.dtype, jnp.inexact))


def eqx_transformer(cfg: EqxTransformerConfig | None = None) -> Workload:
    """The equinox decoder of `cfg` as a `Workload` (loss: next-token cross-entropy).

    >>> import jax
    >>> w = eqx_transformer(EqxTransformerConfig(layers=1))
    >>> state, batch = w.init(0)
    >>> state["params"].blocks[0].attn.query_proj.weight.shape  # (out, in): heads * head_dim first
    (32, 32)
    >>> bool(abs(float(w.loss_fn(state["params"], batch)) - jax.numpy.log(64)) < 0.2)
    True
    """
    import equinox as eqx

    cfg = EqxTransformerConfig() if cfg is None else cfg
    abstract_params, static = _build(cfg)

    def loss_fn(params, batch):
        model = eqx.combine(params, static)
        logits = jax.vmap(model)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return make_workload(
        f"eqx_transformer_l{cfg.layers}",
        cfg,
        loss_fn=loss_fn,
        abstract_params=lambda: abstract_params,
        fill_param=fill_param,
        abstract_batch=functools.partial(lm_abstract_batch, cfg.batch, cfg.seq),
        make_batch=lambda seed: lm_batch(vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq, seed=seed),
        learning_rate=cfg.learning_rate,
    )
