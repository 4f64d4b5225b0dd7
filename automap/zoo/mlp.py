"""A ReLU multi-layer perceptron regression workload (`mlp`), flax linen, MSE loss.

Parameter leaves: ``params/layers_{i}/kernel`` of shape ``(d_prev, d_next)`` and
``params/layers_{i}/bias`` ``(d_next,)`` for ``i`` in ``0 .. len(hidden)``; ReLU (`jax.nn.relu`)
between layers, none after the last; kernels N(0, 1/fan_in), biases zero. The batch is
``{"x": f32[batch, d_in], "y": f32[batch, d_out]}`` with ``y`` a fixed random linear map of
``tanh(x)`` (learnable).

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
import numpy as np

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


def mlp(cfg: MLPConfig | None = None) -> Workload:
    """The ReLU MLP regression problem of `cfg` as a `Workload` (MSE loss, zoo optimizer).

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.mlp(zoo.MLPConfig(d_in=4, hidden=(8,), d_out=2, batch=2))
    >>> state, batch = w.init(0)
    >>> batch["x"].shape, batch["y"].shape
    ((2, 4), (2, 2))
    """
    cfg = MLPConfig() if cfg is None else cfg
    return regression_workload(f"mlp_{len(cfg.hidden) + 1}l", cfg, MLP(cfg))


def regression_workload(name: str, cfg, model) -> Workload:
    """A flax module ``model`` fitting ``y = tanh(x) @ w`` (MSE loss, zoo optimizer); ``cfg`` has
    ``d_in``, ``d_out``, ``batch`` and ``learning_rate``. Shared by the MLP and branches models."""
    x_spec = jax.ShapeDtypeStruct((cfg.batch, cfg.d_in), jnp.float32)
    y_spec = jax.ShapeDtypeStruct((cfg.batch, cfg.d_out), jnp.float32)

    def abstract_params():
        return jax.eval_shape(lambda x: model.init(jax.random.key(0), x)["params"], x_spec)

    def fill_param(names, leaf, rng):
        if names[-1] == "bias":
            return np.zeros(leaf.shape)
        return rng.normal(0.0, 1.0 / np.sqrt(leaf.shape[0]), leaf.shape)  # LeCun normal

    def make_batch(seed):
        rng = np.random.default_rng([seed, 1])
        x = rng.normal(size=x_spec.shape)
        w = rng.normal(size=(cfg.d_in, cfg.d_out)) / np.sqrt(cfg.d_in)
        return {"x": x, "y": np.tanh(x) @ w}

    def loss_fn(params, batch):
        pred = model.apply({"params": params}, batch["x"])
        return jnp.mean((pred - batch["y"]) ** 2)

    return make_workload(
        name,
        cfg,
        loss_fn=loss_fn,
        abstract_params=abstract_params,
        fill_param=fill_param,
        abstract_batch=lambda: {"x": x_spec, "y": y_spec},
        make_batch=make_batch,
        learning_rate=cfg.learning_rate,
    )
