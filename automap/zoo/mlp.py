"""A ReLU multi-layer perceptron regression workload (`mlp`), flax linen, MSE loss.

Parameter leaves: ``params/layers_{i}/kernel`` of shape ``(d_prev, d_next)`` and
``params/layers_{i}/bias`` ``(d_next,)`` for ``i`` in ``0 .. len(hidden)``; ReLU (`jax.nn.relu`)
between layers, none after the last. The batch is ``{"x": f32[batch, d_in], "y": f32[batch, d_out]}``
with ``y`` a fixed random linear map of ``tanh(x)`` (learnable).

>>> from automap import zoo
>>> w = zoo.mlp(zoo.MLPConfig(d_in=32, hidden=(64, 64), d_out=16, batch=8))
>>> w.name, w.abstract()[0]["params"]["layers_2"]["kernel"].shape
('mlp_3l', (64, 16))
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """Sizes of the `mlp` workload: ``d_in -> hidden[0] -> ... -> d_out``.

    >>> MLPConfig(hidden=(128,)).hidden
    (128,)
    """

    d_in: int = 32
    hidden: tuple[int, ...] = (64, 64)
    d_out: int = 16
    batch: int = 8
    learning_rate: float = 1e-3

    def __post_init__(self):
        object.__setattr__(self, "hidden", tuple(self.hidden))  # lists welcome, stays hashable


class MLP(nn.Module):
    """Dense layers ``layers_0 .. layers_n`` with ReLU between them."""

    cfg: MLPConfig

    @nn.compact
    def __call__(self, x):
        widths = self.cfg.hidden + (self.cfg.d_out,)
        for i, width in enumerate(widths):
            x = nn.Dense(width, name=f"layers_{i}")(x)
            if i < len(widths) - 1:
                x = jax.nn.relu(x)
        return x


def mlp(cfg: MLPConfig = MLPConfig()) -> Workload:
    """The ReLU MLP regression problem of `cfg` as a `Workload` (MSE loss, zoo optimizer).

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.mlp(zoo.MLPConfig(d_in=4, hidden=(8,), d_out=2, batch=2))
    >>> state, batch = w.init(0)
    >>> batch["x"].shape, batch["y"].shape
    ((2, 4), (2, 2))
    """
    model = MLP(cfg)

    def init_params(key):
        return model.init(key, jnp.zeros((cfg.batch, cfg.d_in), jnp.float32))["params"]

    def make_batch(key):
        k_x, k_w = jax.random.split(key)
        x = jax.random.normal(k_x, (cfg.batch, cfg.d_in), jnp.float32)
        w = jax.random.normal(k_w, (cfg.d_in, cfg.d_out), jnp.float32) / jnp.sqrt(cfg.d_in)
        return {"x": x, "y": jnp.tanh(x) @ w}

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    return make_workload(
        f"mlp_{len(cfg.hidden) + 1}l",
        cfg,
        loss_fn=loss_fn,
        init_params=init_params,
        make_batch=make_batch,
        learning_rate=cfg.learning_rate,
    )
