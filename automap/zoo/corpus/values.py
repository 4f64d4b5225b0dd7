"""Initial values and batches shared by the corpus models (drawn on the host, nothing compiles).

>>> import jax, jax.numpy as jnp, numpy as np
>>> fill_param(("ln", "scale"), jax.ShapeDtypeStruct((2,), jnp.float32), np.random.default_rng(0))
array([1., 1.])
>>> sorted(lm_batch(vocab=8, batch=2, seq=4, seed=0))
['targets', 'tokens']
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_ZEROS = frozenset({"bias", "mean"})  # biases, BatchNorm running means


def fill_param(names: tuple[str, ...], leaf: jax.ShapeDtypeStruct, rng: np.random.Generator) -> np.ndarray:
    """Biases and running means zero, every other 1-D leaf one (norm scales: flax ``scale``,
    equinox ``weight``, RMSNorm vectors; BatchNorm running variances), the rest N(0, 0.02)."""
    if names and names[-1] in _ZEROS:
        return np.zeros(leaf.shape)
    if len(leaf.shape) == 1:
        return np.ones(leaf.shape)
    return rng.normal(0.0, 0.02, leaf.shape)


def lm_abstract_batch(batch: int, seq: int) -> dict[str, jax.ShapeDtypeStruct]:
    """``tokens`` and ``targets``, int32[batch, seq]."""
    tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return {"tokens": tokens, "targets": tokens}


def lm_batch(*, vocab: int, batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    """Random tokens; each target is the token's successor ``(token + 1) % vocab``."""
    tokens = np.random.default_rng([seed, 1]).integers(0, vocab, (batch, seq), dtype=np.int32)
    return {"tokens": tokens, "targets": (tokens + 1) % vocab}


def image_abstract_batch(batch: int, size: int, channels: int) -> dict[str, jax.ShapeDtypeStruct]:
    """``images`` float32[batch, size, size, channels] (NHWC) and ``labels`` int32[batch]."""
    return {
        "images": jax.ShapeDtypeStruct((batch, size, size, channels), jnp.float32),
        "labels": jax.ShapeDtypeStruct((batch,), jnp.int32),
    }


def image_batch(*, batch: int, size: int, channels: int, classes: int, seed: int) -> dict[str, np.ndarray]:
    """N(0, 1) images and uniform random labels."""
    rng = np.random.default_rng([seed, 2])
    return {
        "images": rng.normal(size=(batch, size, size, channels)).astype(np.float32),
        "labels": rng.integers(0, classes, (batch,), dtype=np.int32),
    }
