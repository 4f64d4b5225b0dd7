"""A small ResNet in flax linen: `nn.Conv` + `nn.BatchNorm` residual blocks, `nn.max_pool` after
the stem, `nn.avg_pool` before the `nn.Dense` classifier. The batch statistics are a mutable
collection: the train step applies the model with ``mutable=["batch_stats"]`` and threads the
updated running averages through the state next to the parameters and the optimizer state.

State: ``{"params", "batch_stats", "opt_state"}``; batch: ``images`` (N, S, S, C), ``labels`` (N,).
Kernels in flax's layouts: ``Conv_*/kernel`` (3, 3, C_in, C_out), ``head/kernel`` (W, classes).

>>> w = linen_resnet(ResNetConfig())
>>> state, batch = w.abstract()
>>> sorted(state), state["params"]["stem"]["kernel"].shape
(['batch_stats', 'opt_state', 'params'], (3, 3, 3, 8))
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import optax

from automap.zoo.corpus.values import fill_param, image_abstract_batch, image_batch
from automap.zoo.train import host_fill, make_optimizer
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class ResNetConfig:
    """Sizes of the ResNet: ``blocks`` residual blocks of ``width`` channels on ``size``² images."""

    size: int = 8
    channels: int = 3
    width: int = 8
    blocks: int = 1
    classes: int = 8
    batch: int = 4
    learning_rate: float = 1e-3


class ResidualBlock(nn.Module):
    width: int

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(self.width, (3, 3), use_bias=False)(x)))
        y = norm()(nn.Conv(self.width, (3, 3), use_bias=False)(y))
        return nn.relu(x + y)


class ResNet(nn.Module):
    cfg: ResNetConfig

    @nn.compact
    def __call__(self, images, train: bool = True):
        cfg = self.cfg
        x = nn.Conv(cfg.width, (3, 3), use_bias=False, name="stem")(images)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, name="stem_bn")(x))
        x = nn.max_pool(x, (2, 2), strides=(2, 2))
        for _ in range(cfg.blocks):
            x = ResidualBlock(cfg.width)(x, train)
        x = nn.avg_pool(x, x.shape[1:3]).reshape(x.shape[0], -1)
        return nn.Dense(cfg.classes, name="head")(x)


def linen_resnet(cfg: ResNetConfig | None = None) -> Workload:
    """The ResNet of `cfg` as a `Workload`; its `loss_fn` is the training-mode loss (no stats out).

    >>> import jax
    >>> w = linen_resnet(ResNetConfig())
    >>> state, batch = w.init(0)
    >>> new_state, loss = jax.jit(w.train_step)(state, batch)
    >>> bool((new_state["batch_stats"]["stem_bn"]["mean"] != 0).any())  # running mean moved
    True
    """
    cfg = ResNetConfig() if cfg is None else cfg
    model = ResNet(cfg)
    optimizer = make_optimizer(cfg.learning_rate)
    batch_spec = image_abstract_batch(cfg.batch, cfg.size, cfg.channels)

    def loss_and_stats(params, batch_stats, batch):
        logits, updates = model.apply(
            {"params": params, "batch_stats": batch_stats}, batch["images"], mutable=["batch_stats"]
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()
        return loss, updates["batch_stats"]

    def train_step(state, batch):
        params = state["params"]
        (loss, stats), grads = jax.value_and_grad(loss_and_stats, has_aux=True)(
            params, state["batch_stats"], batch
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        new = {"params": optax.apply_updates(params, updates), "batch_stats": stats}
        return {**new, "opt_state": opt_state}, loss

    def abstract():
        variables = jax.eval_shape(
            lambda: model.init(jax.random.key(0), jax.numpy.zeros(batch_spec["images"].shape))
        )
        params = variables["params"]
        state = {"params": params, "batch_stats": variables["batch_stats"]}
        return {**state, "opt_state": jax.eval_shape(optimizer.init, params)}, batch_spec

    def init(seed: int = 0):
        state, _ = abstract()
        opt_state = jax.tree.map(lambda leaf: jax.numpy.zeros(leaf.shape, leaf.dtype), state["opt_state"])
        filled = {k: host_fill(state[k], seed, fill_param) for k in ("params", "batch_stats")}
        batch = image_batch(batch=cfg.batch, size=cfg.size, channels=cfg.channels, classes=cfg.classes, seed=seed)
        return jax.device_put(({**filled, "opt_state": opt_state}, batch))

    def loss_fn(params, batch):  # training mode normalises by batch statistics: the running ones are unused
        stats = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), abstract()[0]["batch_stats"])
        return loss_and_stats(params, stats, batch)[0]

    return Workload(
        name=f"linen_resnet_b{cfg.blocks}",
        config=cfg,
        train_step=train_step,
        loss_fn=loss_fn,
        init=init,
        abstract=abstract,
    )
