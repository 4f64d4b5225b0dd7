"""Shared training code of the zoo: optimizer, train step, workload assembly and GPT math helpers.

Every zoo model uses the same optimizer, ``clip_by_global_norm(1.0)`` then ``adamw(lr, 0.01)``, and
the same train step: ``jax.value_and_grad`` of the loss, ``optimizer.update``, ``apply_updates``.
The train state is a plain dict ``{"params": params, "opt_state": opt_state}``.

>>> import jax, jax.numpy as jnp
>>> loss_fn = lambda p, b: jnp.mean((b["x"] * p["w"] - b["y"]) ** 2)
>>> step = make_train_step(loss_fn, make_optimizer(0.1))
>>> state = init_state({"w": jnp.ones(3)}, make_optimizer(0.1))
>>> state, loss = jax.jit(step)(state, {"x": jnp.ones(3), "y": jnp.zeros(3)})
>>> float(loss)
1.0
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from automap.zoo.workload import GPTConfig, PyTree, Workload


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The zoo optimizer: global-norm clipping at 1.0 followed by AdamW (weight decay 0.01).

    >>> opt = make_optimizer(1e-3)
    >>> opt_state = opt.init({"w": jax.numpy.zeros(2)})
    """
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.01))


def init_state(params: PyTree, optimizer: optax.GradientTransformation) -> dict[str, PyTree]:
    """``{"params": params, "opt_state": optimizer.init(params)}``.

    >>> sorted(init_state({"w": jax.numpy.zeros(2)}, make_optimizer(1e-3)))
    ['opt_state', 'params']
    """
    return {"params": params, "opt_state": optimizer.init(params)}


def make_train_step(
    loss_fn: Callable[[PyTree, PyTree], jax.Array], optimizer: optax.GradientTransformation
) -> Callable[[PyTree, PyTree], tuple[PyTree, jax.Array]]:
    """A pure ``train_step(state, batch) -> (new_state, loss)`` for `loss_fn` and `optimizer`.

    See the module docstring for an example.
    """

    def train_step(state, batch):
        params = state["params"]
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, state["opt_state"], params)
        return {"params": optax.apply_updates(params, updates), "opt_state": opt_state}, loss

    return train_step


def make_workload(
    name: str,
    config: Any,
    *,
    loss_fn: Callable[[PyTree, PyTree], jax.Array],
    init_params: Callable[[jax.Array], PyTree],
    make_batch: Callable[[jax.Array], PyTree],
    learning_rate: float,
) -> Workload:
    """Assemble a `Workload` from a loss, a parameter initialiser and a batch maker (both keyed).

    ``init(seed)`` runs one function of the seed eagerly (op by op: tiny models compile faster that
    way), so results are deterministic for a seed; ``abstract()`` is ``jax.eval_shape`` of it.

    >>> import jax.numpy as jnp
    >>> w = make_workload("toy", None, loss_fn=lambda p, b: jnp.sum(p["w"] * b["x"]),
    ...                   init_params=lambda k: {"w": jax.random.normal(k, (3,))},
    ...                   make_batch=lambda k: {"x": jnp.ones(3)}, learning_rate=0.1)
    >>> w.abstract()[0]["params"]["w"].shape
    (3,)
    """
    optimizer = make_optimizer(learning_rate)

    def build(seed):
        k_params, k_batch = jax.random.split(jax.random.key(seed))
        return init_state(init_params(k_params), optimizer), make_batch(k_batch)

    def init(seed: int = 0):
        return build(jnp.asarray(seed, jnp.uint32))

    def abstract():
        return jax.eval_shape(build, jax.ShapeDtypeStruct((), jnp.uint32))

    return Workload(
        name=name,
        config=config,
        train_step=make_train_step(loss_fn, optimizer),
        loss_fn=loss_fn,
        init=init,
        abstract=abstract,
    )


# --- GPT helpers shared by the linen and nnx front ends (identical math) -------------------------


def gpt_batch(cfg: GPTConfig, key: jax.Array) -> dict[str, jax.Array]:
    """Random tokens; the target of each token is its successor ``(token + 1) % vocab`` (learnable).

    With ``cfg.dropout > 0`` the batch also holds ``"rng"``: uint32[2] key data for dropout.
    """
    k_tok, k_rng = jax.random.split(key)
    tokens = jax.random.randint(k_tok, (cfg.batch, cfg.seq), 0, cfg.vocab, dtype=jnp.int32)
    batch = {"tokens": tokens, "targets": (tokens + 1) % cfg.vocab}
    if cfg.dropout > 0:
        batch["rng"] = jax.random.key_data(k_rng)
    return batch


def dropout_key(batch: PyTree) -> jax.Array | None:
    """The typed dropout key of a GPT batch, or None when the batch carries no ``"rng"``."""
    rng = batch.get("rng") if isinstance(batch, dict) else None
    return None if rng is None else jax.random.wrap_key_data(rng)


def dropout(x: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Inverted dropout; the identity when ``rate == 0`` or there is no key."""
    if rate == 0.0 or key is None:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, *, rate: float = 0.0, key: jax.Array | None = None
) -> jax.Array:
    """Causal softmax attention over ``[batch, seq, heads, head_dim]`` inputs, same layout out."""
    seq, head_dim = q.shape[1], q.shape[-1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(jnp.float32(head_dim)).astype(q.dtype)
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    probs = dropout(jax.nn.softmax(logits, axis=-1), rate, key)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer targets."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
