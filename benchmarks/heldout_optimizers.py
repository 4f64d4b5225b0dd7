"""Held-out probe workloads for ``benchmarks/fidelity.py --workload``: one small flax linen model
trained with optimizers other than the zoo's AdamW (``make_workload(..., optimizer=...)``; its state is
``optimizer.init`` of the filled parameters). ``muon``: ``optax.contrib.muon`` (Newton-Schulz
orthogonalised momentum on the 2-D kernels, Adam on the rest); ``novograd``: layer-wise second
moments (one norm per leaf); ``multisteps``: ``optax.MultiSteps(adam, 2)`` (gradient accumulation
under ``lax.cond``); ``prodigy``: ``optax.contrib.prodigy`` (a global step size from dot products of
every leaf); ``adafactor``: factored second moments (row and column means of each kernel);
``lion_clip``: ``clip_by_global_norm(1.0)`` then ``optax.lion``. The model: Dense 32->64,
LayerNorm, gelu, Dense 64->64, gelu, Dense 64->8, softmax cross-entropy; batch 16.

    python benchmarks/fidelity.py --episodes 16 \\
        --workload benchmarks/heldout_optimizers.py:muon \\
        --workload benchmarks/heldout_optimizers.py:novograd \\
        --workload benchmarks/heldout_optimizers.py:multisteps \\
        --workload benchmarks/heldout_optimizers.py:prodigy \\
        --workload benchmarks/heldout_optimizers.py:adafactor \\
        --workload benchmarks/heldout_optimizers.py:lion_clip

FIGURES
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from automap.zoo.train import make_workload

B, D_IN, H, C = 16, 32, 64, 8


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.LayerNorm()(nn.Dense(H)(x)))
        x = nn.gelu(nn.Dense(H)(x))
        return nn.Dense(C)(x)


def _fill(names, leaf, rng):
    if names[-1] == "scale":
        return np.ones(leaf.shape)
    if names[-1] == "bias":
        return np.zeros(leaf.shape)
    return rng.normal(0.0, 1.0 / np.sqrt(leaf.shape[0]), leaf.shape)


def _batch_spec():
    return {"x": jax.ShapeDtypeStruct((B, D_IN), jnp.float32), "labels": jax.ShapeDtypeStruct((B,), jnp.int32)}


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.normal(size=(B, D_IN)).astype(np.float32), "labels": rng.integers(0, C, (B,)).astype(np.int32)}


def _workload(name, optimizer):
    model = _MLP()

    def loss_fn(params, batch):
        logits = model.apply(params, batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"]).mean()

    def abstract_params():
        return jax.eval_shape(model.init, jax.random.key(0), jax.ShapeDtypeStruct((B, D_IN), jnp.float32))

    return make_workload(name, None, loss_fn=loss_fn, abstract_params=abstract_params, fill_param=_fill,
                         abstract_batch=_batch_spec, make_batch=_batch, learning_rate=1e-3,
                         optimizer=optimizer)


def muon():
    return _workload("muon", optax.contrib.muon(1e-3))


def novograd():
    return _workload("novograd", optax.novograd(1e-3))


def multisteps():
    return _workload("multisteps", optax.MultiSteps(optax.adam(1e-3), 2))


def prodigy():
    return _workload("prodigy", optax.contrib.prodigy(1.0))


def adafactor():
    return _workload("adafactor", optax.adafactor(1e-2, min_dim_size_to_factor=16))


def lion_clip():
    return _workload("lion_clip", optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-4)))
