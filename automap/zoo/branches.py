"""A two-branch regression workload (`branches`), flax linen, MSE loss.

The model adds two parallel branches that read the same input::

    y = w_out(gelu(w_a(x)) * w_b(x)) + v_out(relu(v_a(x)))

a gated branch (``w_a``, ``w_b`` -> ``w_out``) and a plain one (``v_a`` -> ``v_out``). Parameter
leaves are ``params/{w_a,w_b,v_a}/kernel`` ``(d_in, hidden)``, ``params/{w_out,v_out}/kernel``
``(hidden, d_out)`` and a ``bias`` next to each kernel; kernels N(0, 1/fan_in), biases zero. The
batch is ``{"x": f32[batch, d_in], "y": f32[batch, d_out]}`` with ``y`` a fixed random linear map
of ``tanh(x)``. Tensor parallelism pairs ``w_a`` (column) with ``w_out`` (row) and ``v_a`` with
``v_out``; ``w_b`` follows ``w_a`` through the product.

>>> from automap import zoo
>>> w = zoo.branches(zoo.BranchesConfig(d_in=8, hidden=16, d_out=4, batch=2))
>>> w.name, w.abstract()[0]["params"]["w_out"]["kernel"].shape
('branches', (16, 4))
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax

from automap.zoo.workload import Workload
from automap.zoo.mlp import regression_workload


@dataclasses.dataclass(frozen=True)
class BranchesConfig:
    """Sizes of the `branches` workload (both branches share ``hidden``).

    >>> BranchesConfig(hidden=128).hidden
    128
    """

    d_in: int = 32
    hidden: int = 64
    d_out: int = 16
    batch: int = 8
    learning_rate: float = 1e-3


class Branches(nn.Module):
    """``w_out(gelu(w_a(x)) * w_b(x)) + v_out(relu(v_a(x)))``."""

    cfg: BranchesConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gated = jax.nn.gelu(nn.Dense(cfg.hidden, name="w_a")(x)) * nn.Dense(cfg.hidden, name="w_b")(x)
        plain = jax.nn.relu(nn.Dense(cfg.hidden, name="v_a")(x))
        return nn.Dense(cfg.d_out, name="w_out")(gated) + nn.Dense(cfg.d_out, name="v_out")(plain)


def branches(cfg: BranchesConfig | None = None) -> Workload:
    """The two-branch regression problem of `cfg` as a `Workload` (MSE loss, zoo optimizer).

    >>> import jax
    >>> from automap import zoo
    >>> w = zoo.branches(zoo.BranchesConfig(d_in=4, hidden=8, d_out=2, batch=2))
    >>> state, batch = w.init(0)
    >>> sorted(state["params"]), batch["y"].shape
    (['v_a', 'v_out', 'w_a', 'w_b', 'w_out'], (2, 2))
    """
    cfg = BranchesConfig() if cfg is None else cfg
    return regression_workload("branches", cfg, Branches(cfg))
