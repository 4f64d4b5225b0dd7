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

Measured on jax 0.10.2 / optax 0.2.8, mesh 2x4 (48 plans, 8 per probe), before this branch's two
fixes: bytes sent outside 10% in 2, memory outside 25% in 5, dot FLOPs outside 5% in 5; jit parity
0 of 18, the default dominated in 0 of 18. After them, novograd, multisteps and prodigy rerun
(24 plans; muon, adafactor and lion_clip not rerun): bytes sent outside in 0, memory in 0, dot
FLOPs in 0, jit parity 0 of 9, dominated 0 of 9; with muon's memory rows, 0 / 5 / 0 of 48.

- novograd and multisteps manual_fsdp, bytes sent 1.30 and 1.29 (fsdp 0.95, 0.94), now 1.00 / 1.00
  (1.01 / 1.01): both update under ``lax.cond`` (novograd's first-step branch, MultiSteps'
  accumulate-or-apply). XLA hands Shardy a ``stablehlo.case`` whose branches read the gradients as
  free variables, so the branches' elementwise ops give a weight gradient the weight's layout in
  the first rounds; ``automap.xla_layout`` took the cond as one op, moving axes only from the round
  of parallel factors, after the gradient's dot had laid it out otherwise (an all-to-all per
  branch XLA does not emit). Now a cond is taken as its ties and data-flow edges
  (``automap.xla_loops``).
- prodigy, dot FLOPs 1.02 to 1.19 (manual_dp), now 1.00 in all 8: ``optax.tree.vdot`` of every leaf
  (its step-size estimate) is a ``dot_general`` without free dims, which XLA:CPU's algebraic
  simplifier rewrites into a multiply and a reduction (no dot instruction);
  ``automap.cost.flops.dot_flops`` now counts none for it on CPU.
- muon, memory 0.59 to 0.62 where the Newton-Schulz matrices are whole (default, data_parallel,
  megatron_dp, manual_dp, manual_megatron_dp; left): the estimate's temp is 64 KiB, XLA's 178 to
  187 KiB. optax's Newton-Schulz loop is ``fori_loop(..., unroll=True)``, a ``scan`` that XLA gets
  as straight-line code, and XLA:CPU duplicates each step's cheap ``a * x + b @ x`` into every
  consumer fusion, so the last step's fusion recomputes every earlier ``x`` from the parameter and
  each step's product, all live to the end: on one 64x64 matrix XLA's temp is 49, 65 and 115 KiB
  for 1, 2 and 5 steps (16 KiB more per step), the estimate's 65 KiB for any (it prices the scan as
  a loop: one iteration's peak). Modelling it needs an unrolled scan's body laid out ``length``
  times and fused values that a dot reads stored for the dot only; tried the second alone
  (``automap.cost.memory``), which does not reach the scan body, and dropped it.
  Since modelled (``automap.cost.unrolled``); megatron_dp stayed at 0.62, its scan priced as a loop
  because its body all-reduces ``x @ x.T`` summed over the kernel's split columns: the body's
  result reshards now go with each copy, 0.94 (muon 8 plans: memory outside 25% in 1 -> 0).
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
