"""A small ViT in flax linen: a patch-embedding `nn.Conv` (kernel = stride = patch), a learned
position embedding, pre-LN encoder blocks of `nn.MultiHeadDotProductAttention` and an `nn.Dense`
MLP, mean pooling and an `nn.Dense` classifier.

Kernels in flax's layouts: ``patch/kernel`` (P, P, C, D); in ``block_{i}``:
``attn/{query,key,value}/kernel`` (D, H, Dh), ``attn/out/kernel`` (H, Dh, D), ``mlp_in/kernel``
(D, F), ``mlp_out/kernel`` (F, D); ``head/kernel`` (D, classes).

>>> w = linen_vit(ViTConfig())
>>> w.abstract()[0]["params"]["block_0"]["attn"]["query"]["kernel"].shape
(32, 4, 8)
"""

from __future__ import annotations

import dataclasses
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from automap.zoo.corpus.values import fill_param, image_abstract_batch, image_batch
from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """Sizes of the ViT (``size`` divisible by ``patch``, ``d_model`` by ``heads``)."""

    size: int = 8
    patch: int = 4
    channels: int = 3
    d_model: int = 32
    heads: int = 4
    hidden: int = 64
    layers: int = 1
    classes: int = 8
    batch: int = 4
    learning_rate: float = 1e-3


class EncoderBlock(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        h = nn.LayerNorm(name="ln1")(x)
        x = x + nn.MultiHeadDotProductAttention(num_heads=cfg.heads, name="attn")(h, h)
        h = nn.LayerNorm(name="ln2")(x)
        return x + nn.Dense(cfg.d_model, name="mlp_out")(nn.gelu(nn.Dense(cfg.hidden, name="mlp_in")(h)))


class ViT(nn.Module):
    cfg: ViTConfig

    @nn.compact
    def __call__(self, images):
        cfg = self.cfg
        x = nn.Conv(cfg.d_model, (cfg.patch, cfg.patch), strides=(cfg.patch, cfg.patch), name="patch")(images)
        x = x.reshape(x.shape[0], -1, cfg.d_model)  # (batch, patches, d_model)
        x = x + self.param("pos", nn.initializers.normal(0.02), (1, x.shape[1], cfg.d_model))
        for i in range(cfg.layers):
            x = EncoderBlock(cfg, name=f"block_{i}")(x)
        return nn.Dense(cfg.classes, name="head")(nn.LayerNorm(name="ln_f")(x).mean(axis=1))


def linen_vit(cfg: ViTConfig | None = None) -> Workload:
    """The ViT of `cfg` as a `Workload` (loss: softmax cross-entropy on the labels).

    >>> import jax
    >>> w = linen_vit(ViTConfig())
    >>> state, batch = w.init(0)
    >>> bool(abs(float(w.loss_fn(state["params"], batch)) - jax.numpy.log(8)) < 0.2)
    True
    """
    cfg = ViTConfig() if cfg is None else cfg
    if cfg.size % cfg.patch:
        raise ValueError(f"ViTConfig: size={cfg.size} is not divisible by patch={cfg.patch}")
    model = ViT(cfg)
    batch_spec = image_abstract_batch(cfg.batch, cfg.size, cfg.channels)

    def abstract_params():
        return jax.eval_shape(lambda: model.init(jax.random.key(0), jnp.zeros(batch_spec["images"].shape)))["params"]

    def loss_fn(params, batch):
        logits = model.apply({"params": params}, batch["images"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    return make_workload(
        f"linen_vit_l{cfg.layers}",
        cfg,
        loss_fn=loss_fn,
        abstract_params=abstract_params,
        fill_param=fill_param,
        abstract_batch=lambda: batch_spec,
        make_batch=lambda seed: image_batch(
            batch=cfg.batch, size=cfg.size, channels=cfg.channels, classes=cfg.classes, seed=seed
        ),
        learning_rate=cfg.learning_rate,
    )
