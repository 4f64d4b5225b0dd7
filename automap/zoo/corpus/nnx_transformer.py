"""A decoder built only from flax nnx's layer library: `nnx.Embed`, `nnx.MultiHeadAttention`
(causal mask), `nnx.LayerNorm` and `nnx.Linear`; the train state is the nnx state as a pure dict.

Parameters (``L`` blocks; kernels in flax's layouts)::

    params/embed/embedding                          (V, D)
    params/blocks/{i}/attn/{query,key,value}/kernel (D, H, Dh)    bias (H, Dh)
    params/blocks/{i}/attn/out/kernel               (H, Dh, D)    bias (D,)
    params/blocks/{i}/{ln1,ln2}/{scale,bias}        (D,)
    params/blocks/{i}/up/kernel                     (D, F)        bias (F,)
    params/blocks/{i}/down/kernel                   (F, D)        bias (D,)
    params/ln_f/{scale,bias}, params/head/kernel    (D,), (D, V)

>>> w = nnx_transformer(NNXTransformerConfig(layers=1))
>>> w.abstract()[0]["params"]["blocks"][0]["attn"]["query"]["kernel"].shape
(32, 4, 8)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from automap.zoo.corpus.values import fill_param, lm_abstract_batch, lm_batch
from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class NNXTransformerConfig:
    """Sizes of the nnx decoder (``d_model`` divisible by ``heads``)."""

    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 1
    batch: int = 4
    learning_rate: float = 1e-3


class Block(nnx.Module):
    def __init__(self, cfg: NNXTransformerConfig, rngs: nnx.Rngs):
        self.ln1 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.d_model, decode=False, rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.up = nnx.Linear(cfg.d_model, cfg.hidden, rngs=rngs)
        self.down = nnx.Linear(cfg.hidden, cfg.d_model, rngs=rngs)

    def __call__(self, x, mask):
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class Decoder(nnx.Module):
    def __init__(self, cfg: NNXTransformerConfig, rngs: nnx.Rngs):
        self.embed = nnx.Embed(cfg.vocab, cfg.d_model, rngs=rngs)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.layers)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, rngs=rngs)
        self.head = nnx.Linear(cfg.d_model, cfg.vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens)
        mask = nnx.make_causal_mask(tokens)
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))


def nnx_transformer(cfg: NNXTransformerConfig | None = None) -> Workload:
    """The nnx decoder of `cfg` as a `Workload` (loss: next-token cross-entropy).

    >>> import jax
    >>> w = nnx_transformer(NNXTransformerConfig(layers=1))
    >>> state, batch = w.init(0)
    >>> bool(abs(float(w.loss_fn(state["params"], batch)) - jax.numpy.log(64)) < 0.2)  # ~ uniform
    True
    """
    cfg = NNXTransformerConfig() if cfg is None else cfg
    graphdef, abstract_state = nnx.split(nnx.eval_shape(lambda: Decoder(cfg, nnx.Rngs(0))))

    def loss_fn(params, batch):
        state = jax.tree.map(lambda x: x, abstract_state)
        nnx.replace_by_pure_dict(state, params)
        logits = nnx.merge(graphdef, state)(batch["tokens"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return make_workload(
        f"nnx_transformer_l{cfg.layers}",
        cfg,
        loss_fn=loss_fn,
        abstract_params=lambda: nnx.to_pure_dict(abstract_state),
        fill_param=fill_param,
        abstract_batch=functools.partial(lm_abstract_batch, cfg.batch, cfg.seq),
        make_batch=lambda seed: lm_batch(vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq, seed=seed),
        learning_rate=cfg.learning_rate,
    )
