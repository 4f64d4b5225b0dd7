"""Mixture-of-experts language models in pure JAX, two ways to route tokens to experts:

- `moe_ragged`: top-1 routing; the tokens are sorted by expert and each expert's contiguous group
  goes through its own weights with `jax.lax.ragged_dot` (the dropless "megablocks" form);
- `moe_einsum`: GShard-style top-2 routing, each sequence a group with a fixed capacity per
  expert; one-hot dispatch and combine tensors (group x tokens x experts x capacity) move tokens
  in and out with einsums.

Both embed the tokens, apply ``x + moe(norm(x))`` and a vocabulary head. Parameters::

    params/embed       (V, D)           params/router   (D, E)
    params/w_in        (E, D, F)        params/w_out    (E, F, D)
    params/norm        (D,)             params/head     (D, V)

>>> w = moe_ragged(MoEConfig())
>>> w.abstract()[0]["params"]["w_in"].shape
(4, 32, 64)
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.corpus.llama_gqa import rms_norm
from automap.zoo.corpus.values import fill_param, lm_abstract_batch, lm_batch
from automap.zoo.train import make_workload
from automap.zoo.workload import Workload


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Sizes of the MoE model; ``capacity_factor`` sizes `moe_einsum`'s expert buffers."""

    vocab: int = 64
    seq: int = 8
    d_model: int = 32
    hidden: int = 64
    experts: int = 4
    batch: int = 4
    capacity_factor: float = 2.0
    learning_rate: float = 1e-3


def ragged_experts(p, x):
    """Top-1 routing; tokens sorted by expert, `jax.lax.ragged_dot` per contiguous expert group."""
    tokens = x.reshape(-1, x.shape[-1])
    probs = jax.nn.softmax(tokens @ p["router"], axis=-1)
    expert = jnp.argmax(probs, axis=-1)
    gate = jnp.take_along_axis(probs, expert[:, None], axis=-1)
    order = jnp.argsort(expert)
    group_sizes = jnp.bincount(expert, length=p["w_in"].shape[0]).astype(jnp.int32)
    h = jax.nn.gelu(jax.lax.ragged_dot(tokens[order], p["w_in"], group_sizes))
    y = jax.lax.ragged_dot(h, p["w_out"], group_sizes)
    y = jnp.zeros_like(y).at[order].set(y)  # back to token order
    return (y * gate).reshape(x.shape)


def einsum_experts(p, x, capacity_factor: float):
    """GShard's top-2 gating with each sequence a routing group: the second expert is the argmax
    once the first is masked out; one-hot dispatch/combine tensors [group, tokens, experts,
    capacity] and einsums move tokens to the experts and back (capacity is per group)."""
    s, e = x.shape[1], p["router"].shape[1]
    capacity = int(np.ceil(2 * s * capacity_factor / e))
    probs = jax.nn.softmax(jnp.einsum("gsd,de->gse", x, p["router"]), axis=-1)
    mask_1 = jax.nn.one_hot(jnp.argmax(probs, axis=-1), e)
    mask_2 = jax.nn.one_hot(jnp.argmax(probs * (1.0 - mask_1), axis=-1), e)
    # a token's slot in its expert's buffer: first choices, then second choices, in token order
    position_1 = (jnp.cumsum(mask_1, axis=1) - 1.0) * mask_1
    position_2 = (jnp.cumsum(mask_2, axis=1) - 1.0 + jnp.sum(mask_1, axis=1, keepdims=True)) * mask_2
    dispatch = jnp.zeros(x.shape[:2] + (e, capacity), x.dtype)
    combine = jnp.zeros_like(dispatch)
    for mask, position in ((mask_1, position_1), (mask_2, position_2)):
        keep = mask * (position < capacity)
        gate = jnp.sum(probs * keep, axis=-1)  # (g, s)
        slot = jax.nn.one_hot(jnp.sum(position * keep, axis=-1).astype(jnp.int32), capacity)  # (g, s, c)
        routed = jnp.einsum("gse,gsc->gsec", keep, slot)
        dispatch = dispatch + routed
        combine = combine + gate[..., None, None] * routed
    expert_in = jnp.einsum("gsec,gsd->egcd", dispatch, x)
    h = jax.nn.gelu(jnp.einsum("egcd,edf->egcf", expert_in, p["w_in"]))
    expert_out = jnp.einsum("egcf,efd->egcd", h, p["w_out"])
    return jnp.einsum("gsec,egcd->gsd", combine, expert_out)


def _abstract_params(cfg: MoEConfig):
    f32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.float32)
    d, f, e = cfg.d_model, cfg.hidden, cfg.experts
    return {
        "embed": f32((cfg.vocab, d)), "norm": f32((d,)), "router": f32((d, e)),
        "w_in": f32((e, d, f)), "w_out": f32((e, f, d)), "head": f32((d, cfg.vocab)),
    }



def _workload(name: str, cfg: MoEConfig, experts_fn) -> Workload:
    def loss_fn(params, batch):
        x = params["embed"][batch["tokens"]]
        x = x + experts_fn(params, rms_norm(x, params["norm"]))
        logits = x @ params["head"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    return make_workload(
        name,
        cfg,
        loss_fn=loss_fn,
        abstract_params=functools.partial(_abstract_params, cfg),
        fill_param=fill_param,
        abstract_batch=functools.partial(lm_abstract_batch, cfg.batch, cfg.seq),
        make_batch=lambda seed: lm_batch(vocab=cfg.vocab, batch=cfg.batch, seq=cfg.seq, seed=seed),
        learning_rate=cfg.learning_rate,
    )


def moe_ragged(cfg: MoEConfig | None = None) -> Workload:
    """Top-1 MoE with `jax.lax.ragged_dot` (tokens sorted by expert) as a `Workload`.

    >>> import jax
    >>> state, batch = moe_ragged(MoEConfig()).init(0)
    >>> new_state, loss = jax.jit(moe_ragged(MoEConfig()).train_step)(state, batch)
    >>> bool(abs(float(loss) - jax.numpy.log(64)) < 0.2)
    True
    """
    return _workload("moe_ragged", MoEConfig() if cfg is None else cfg, ragged_experts)


def moe_einsum(cfg: MoEConfig | None = None) -> Workload:
    """GShard-style top-2 MoE with einsum dispatch and combine as a `Workload`.

    >>> import jax
    >>> cfg = MoEConfig()
    >>> state, batch = moe_einsum(cfg).init(0)
    >>> bool(abs(float(moe_einsum(cfg).loss_fn(state["params"], batch)) - jax.numpy.log(64)) < 0.2)
    True
    """
    cfg = MoEConfig() if cfg is None else cfg
    return _workload("moe_einsum", cfg, functools.partial(einsum_experts, capacity_factor=cfg.capacity_factor))
