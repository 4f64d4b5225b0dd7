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

import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.workload import GPTConfig, PyTree, Workload


def make_optimizer(learning_rate: float) -> optax.GradientTransformation:
    """The zoo optimizer: global-norm clipping at 1.0 followed by AdamW (weight decay 0.01).

    >>> opt = make_optimizer(1e-3)
    >>> opt_state = opt.init({"w": jax.numpy.zeros(2)})
    """
    return optax.chain(
        optax.clip_by_global_norm(1.0), optax.adamw(learning_rate, weight_decay=0.01)
    )


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
    abstract_params: Callable[[], PyTree],
    fill_param: Callable[[tuple[str, ...], jax.ShapeDtypeStruct, np.random.Generator], np.ndarray],
    abstract_batch: Callable[[], PyTree],
    make_batch: Callable[[int], PyTree],
    learning_rate: float,
    optimizer: optax.GradientTransformation | None = None,
) -> Workload:
    """Assemble a `Workload`; concrete values are drawn on the host with NumPy (nothing compiles).

    ``abstract()`` is ``abstract_params()`` (a `jax.eval_shape` of the model's init),
    ``jax.eval_shape(optimizer.init, ...)`` and ``abstract_batch()``. ``init(seed)`` fills that
    structure: each parameter leaf by ``fill_param(names, leaf, rng)`` with a generator seeded by
    ``(seed, path)`` (so a leaf's value depends only on the seed, its path and its shape), the
    optimizer state with zeros (the zoo optimizer's initial state: Adam count, mu and nu), and the
    batch by ``make_batch(seed)``. On CPU this avoids compiling a one-off init program per model.

    ``optimizer`` replaces the zoo optimizer (``make_optimizer(learning_rate)``, then unused); its
    state is ``optimizer.init`` of the filled parameters, since another optimizer's initial state
    need not be zeros (Prodigy's step size, Muon's Newton-Schulz coefficients, Adafactor's factors).

    >>> import numpy as np, jax.numpy as jnp
    >>> w = make_workload("toy", None, loss_fn=lambda p, b: jnp.sum(p["w"] * b["x"]),
    ...                   abstract_params=lambda: {"w": jax.ShapeDtypeStruct((3,), jnp.float32)},
    ...                   fill_param=lambda names, leaf, rng: rng.normal(size=leaf.shape),
    ...                   abstract_batch=lambda: {"x": jax.ShapeDtypeStruct((3,), jnp.float32)},
    ...                   make_batch=lambda seed: {"x": np.ones(3, np.float32)}, learning_rate=0.1)
    >>> state, batch = w.init(0)
    >>> state["params"]["w"].dtype, w.abstract()[0]["params"]["w"].shape
    (dtype('float32'), (3,))
    """
    own_optimizer = optimizer is not None
    optimizer = optimizer if own_optimizer else make_optimizer(learning_rate)

    def abstract():
        params = abstract_params()
        return {
            "params": params,
            "opt_state": jax.eval_shape(optimizer.init, params),
        }, abstract_batch()

    def init(seed: int = 0):
        state, batch_spec = abstract()
        params = host_fill(state["params"], seed, fill_param)
        if own_optimizer:
            opt_state = jax.tree.map(np.asarray, optimizer.init(params))
        else:
            opt_state = jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), state["opt_state"])
        batch = jax.tree.map(lambda b, s: np.asarray(b, s.dtype), make_batch(seed), batch_spec)
        return jax.device_put(({"params": params, "opt_state": opt_state}, batch))

    return Workload(
        name=name,
        config=config,
        train_step=make_train_step(loss_fn, optimizer),
        loss_fn=loss_fn,
        init=init,
        abstract=abstract,
    )


def host_fill(
    tree: PyTree,
    seed: int,
    fill_param: Callable[[tuple[str, ...], jax.ShapeDtypeStruct, np.random.Generator], np.ndarray],
) -> PyTree:
    """NumPy values for a pytree of `jax.ShapeDtypeStruct`: ``fill_param(names, leaf, rng)`` per leaf.

    ``names`` are the leaf's path entries as strings (dict keys, attribute names, indices); the
    generator is seeded by ``(seed, path)``, so a leaf's value depends only on those and its shape.

    >>> tree = {"w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    >>> host_fill(tree, 0, lambda names, leaf, rng: np.full(leaf.shape, len(names)))["w"]
    array([1., 1.], dtype=float32)
    """

    def param(path, leaf):
        names = tuple(_entry_name(k) for k in path)
        entropy = [seed, 0, zlib.crc32("/".join(names).encode())]
        return np.asarray(fill_param(names, leaf, np.random.default_rng(entropy)), leaf.dtype)

    return jax.tree_util.tree_map_with_path(param, tree)


def _entry_name(entry) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


# --- GPT helpers shared by the linen and nnx front ends (identical math) -------------------------


def gpt_fill_param(names: tuple[str, ...], leaf: jax.ShapeDtypeStruct, rng: np.random.Generator):
    """GPT initial values: layer-norm ``scale`` ones, biases zeros, everything else N(0, 0.02)."""
    if names[-1] == "scale":
        return np.ones(leaf.shape)
    if names[-1] == "bias":
        return np.zeros(leaf.shape)
    return rng.normal(0.0, 0.02, leaf.shape)


def _key_data_shape() -> jax.ShapeDtypeStruct:
    return jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0)))


def gpt_abstract_batch(cfg: GPTConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """``tokens``/``targets`` int32[batch, seq], and ``rng`` (key data) if ``cfg.dropout > 0``."""
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    batch = {"tokens": tokens, "targets": tokens}
    if cfg.dropout > 0:
        batch["rng"] = _key_data_shape()
    return batch


def gpt_batch(cfg: GPTConfig, seed: int) -> dict[str, np.ndarray]:
    """Random tokens; the target of each token is its successor ``(token + 1) % vocab`` (learnable).

    With ``cfg.dropout > 0`` the batch also holds ``"rng"``: random uint32 key data for dropout.
    """
    rng = np.random.default_rng([seed, 1])
    tokens = rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq), dtype=np.int32)
    batch = {"tokens": tokens, "targets": (tokens + 1) % cfg.vocab}
    if cfg.dropout > 0:
        batch["rng"] = rng.integers(0, 2**32, _key_data_shape().shape, dtype=np.uint32)
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
    """Causal softmax attention over ``[batch, seq, heads, head_dim]`` inputs, same layout out.

    With fewer key/value heads than query heads (GQA; MQA with one), each key/value head serves a
    group of ``heads // kv_heads`` consecutive query heads.
    """
    b, seq, heads, head_dim = q.shape
    kv_heads = k.shape[2]
    scale = lambda: jnp.sqrt(jnp.float32(head_dim)).astype(q.dtype)  # noqa: E731 (traced where it was)
    if kv_heads == heads:
        probs = _causal_probs(jnp.einsum("bqhd,bkhd->bhqk", q, k) / scale(), rate, key)
        return jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    q = q.reshape(b, seq, kv_heads, heads // kv_heads, head_dim)  # query groups
    probs = _causal_probs(jnp.einsum("bqkgd,bskd->bkgqs", q, k) / scale(), rate, key)
    return jnp.einsum("bkgqs,bskd->bqkgd", probs, v).reshape(b, seq, heads, head_dim)


def _causal_probs(logits: jax.Array, rate: float, key: jax.Array | None) -> jax.Array:
    """Softmax over the last (key) axis with future keys masked; the query axis is second last."""
    seq = logits.shape[-1]
    mask = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    return dropout(jax.nn.softmax(logits, axis=-1), rate, key)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy with integer targets."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
